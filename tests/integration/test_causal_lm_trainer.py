"""The built-in causal_lm trainer end to end in its child process: a tiny llama from the worker's
cache, a tiny JSONL shard, three optimizer steps; only the adapter comes back, with loss and val_loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apiary import weights as w
from apiary.strategies.format import UpdateFormat
from apiary.trainers import BUILT_IN, TrainCall, TrainerSetup, make_trainer
from apiary.trainers.causal_lm_adapter import initial_adapter
from apiary.trainers.causal_lm_config import CausalLMConfig
from tests.fixtures import tiny_llm

pytestmark = pytest.mark.slow  # each case starts a deployment of processes or trains in a child


async def test_three_steps_in_the_child_return_the_adapter_alone_with_loss_and_val_loss(tmp_path: Path) -> None:
    # Prepare
    from transformers import AutoConfig

    model_dir = tiny_llm.save_model(tmp_path / "model")
    env = {"USE_PEFT": True, "LORA_R": 4, "BATCH_SIZE": 4, "STEPS_PER_ROUND": 3, "VALIDATION_SPLIT": 0.25}
    start = initial_adapter(AutoConfig.from_pretrained(str(model_dir)).to_dict(), CausalLMConfig(lora_r=4))
    (tmp_path / "global.safetensors").write_bytes(w.dumps(start))
    call = TrainCall(module="", function="", weights_path=str(tmp_path / "global.safetensors"),
                     result_path=str(tmp_path / "result.safetensors"), out_dir=str(tmp_path / "out"), env=env,
                     dataset={"data_root": str(tiny_llm.write_shard(tmp_path / "shard"))}, round={"index": 1},
                     job={"id": "j"}, model_path=str(model_dir))
    trainer = make_trainer(BUILT_IN, TrainerSetup(name="t", environment={"HF_HUB_OFFLINE": "1"}))
    live: list[dict[str, Any]] = []

    # Execute
    try:
        result = await trainer.train(call, timeout=300, on_metrics=live.append)
    finally:
        await trainer.stop()

    # Assert
    trained = w.loads(Path(call.result_path).read_bytes())
    assert trainer.update_format(env) is UpdateFormat.ADAPTER
    assert set(trained) == set(start) and result.samples == 9 and set(result.metrics) == {"loss", "val_loss"}
    assert [m["step"] for m in live] == [1, 2, 3] and all("loss" in m["metrics"] for m in live)
