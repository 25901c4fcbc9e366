"""The composition root: the `apiary` command, `apiary run`'s embedded stack and `apiary serve`."""

import time

# When the command started, before its imports (a second or more on a busy machine): `apiary run
# --timeout` counts from here, as the person who typed it does.
STARTED = time.monotonic()
