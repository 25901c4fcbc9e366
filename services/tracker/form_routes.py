"""What the dashboard's job form reads from the API beside the registries: who the token is (the page offers only
what its role may do), the defaults of a request's fields, and a job's own request (to run it again)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from apiary.early_stopping import EarlyStopping
from apiary.jobspec import DistributedConfig, SplitConfig, WorkerSelection
from apiary.trainers.causal_lm_config import CausalLMConfig
from services.tracker.auth import principal_of
from services.tracker.registry_routes import RegistryTracker
from services.tracker.schemas import JOB_ID, NOT_FOUND, PREFIX, no_job
from services.tracker.token_store import Role
from services.tracker.views import job_request, job_status


class TokenView(BaseModel):
    """The token a request came with: its name and role, and what that role may do."""

    name: str
    role: Role
    may_submit: bool = Field(description="submit jobs, register models and datasets, cancel its own jobs")
    may_administer: bool = Field(description="also cancel any job")


class JobDefaults(BaseModel):
    """What each block of a job request holds when the request leaves it out."""

    distributed: DistributedConfig
    worker_selection: WorkerSelection
    split: SplitConfig
    early_stopping: EarlyStopping = Field(description="`distributed.early_stopping` once it is given")
    built_in_config: CausalLMConfig = Field(description="`config` of a job without an entrypoint (the built-in "
                                                        "causal-LM trainer)")


def form_routes(tracker: RegistryTracker) -> APIRouter:
    """`GET /token`, `GET /job-defaults` and `GET /training-jobs/{job_id}/request`."""
    router = APIRouter()

    @router.get("/token", response_model=TokenView)
    async def who_am_i(http: Request) -> TokenView:
        """The request's token: name and role."""
        principal = principal_of(http)
        return TokenView(name=principal.name, role=principal.role, may_submit=principal.may("submitter"),
                         may_administer=principal.may("admin"))

    @router.get("/job-defaults", response_model=JobDefaults)
    async def job_defaults() -> JobDefaults:
        """The value each field of a job request takes when it is left out."""
        return JobDefaults(distributed=DistributedConfig(), worker_selection=WorkerSelection(), split=SplitConfig(),
                           early_stopping=EarlyStopping(), built_in_config=CausalLMConfig.model_validate({}))

    @router.get("/training-jobs/{job_id}/request", responses=NOT_FOUND)
    async def get_request(job_id: str = JOB_ID) -> dict[str, Any]:
        """The request the job was submitted with, without its job id: POST it again to run it again."""
        request = await job_request(tracker.db, job_id)
        if request is not None:
            return request
        if await job_status(tracker.db, job_id) is None:
            raise no_job(job_id)
        raise HTTPException(404, f"job {job_id}'s request is not recorded (yet): see {PREFIX}/training-jobs/{job_id}")

    return router


__all__ = ["JobDefaults", "TokenView", "form_routes"]
