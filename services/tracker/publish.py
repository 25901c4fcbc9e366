"""Publishing a job request on the bus, as any other system would (JSON under `job.requested`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from apiary.bus import Bus
from apiary.bus.base import Unroutable
from apiary.contracts import JSON


async def publish_job_request(bus: Bus, request: dict[str, Any]) -> str:
    """Publish a job request (JSON, as any AMQP client can); return the job id it will carry."""
    body = dict(request)
    body.setdefault("job_id", uuid.uuid4().hex[:12])
    try:
        await bus.publish("job.requested", json.dumps(body).encode(), content_type=JSON)
    except Unroutable:
        raise RuntimeError("no scheduler queue is bound to job.requested: is the scheduler running?") from None
    return str(body["job_id"])


__all__ = ["publish_job_request"]
