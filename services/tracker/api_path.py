"""What the tracker's HTTP API and its clients share: the base path of every route, and the ASGI scope key that
marks a call made in-process (a module of its own, so that a client, and every process that has one, does not
import FastAPI)."""

PREFIX = "/api/v1"
IN_PROCESS_SCOPE_KEY = "apiary.in_process"  # set only by services.tracker.inprocess, never by a server
