"""Ctrl-C and SIGTERM for `apiary run`: caught from the command's first moment to its last, each a request
to stop that the run answers by cancelling its job and printing the summary, however many arrive."""

from __future__ import annotations

import asyncio
import signal
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopSignals:
    """The first SIGINT or SIGTERM the command got (None: none yet). A terminal sends Ctrl-C to the whole
    process group and `timeout` signals the process and then its group: a second signal must not cut
    short the cancelling that the first one started, so every later one is only noted."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._stopping: asyncio.Event | None = None

    def catch(self) -> None:
        """Take SIGINT and SIGTERM from here on (in the main thread, before and after the event loop)."""
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        if self.received is None:
            self.received = signum
        if self._stopping is not None:
            self._stopping.set()

    def attach(self) -> None:
        """While the event loop runs, take the signals through it (so they wake it at once)."""
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self.received is not None:
            self._stopping.set()

    def detach(self) -> None:
        """Back to catching them outside the loop, before it closes (which would restore the defaults)."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        self._stopping = None
        self.catch()

    async def wait(self) -> int:
        """Until a signal came (attached only); which one."""
        assert self._stopping is not None, "attach() first"
        await self._stopping.wait()
        assert self.received is not None
        return self.received

    @property
    def said(self) -> str:
        """How the reason names the signal: `Ctrl-C` or `SIGTERM`."""
        return NAMES.get(signal.Signals(self.received), str(self.received)) if self.received else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process it stopped."""
        return 128 + (self.received or 0)


__all__ = ["StopSignals"]
