"""The composition root: the `apiary` command, `apiary run`'s embedded stack and `apiary serve`."""
