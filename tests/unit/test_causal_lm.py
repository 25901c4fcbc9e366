"""The causal-LM trainer's pure parts and helpers on a tiny random llama: records, splits and batches,
config from env, precision refusals, LoRA targets, round 0's adapter from the config alone, and the
adapter folder PEFT loads as is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from apiary import weights as w
from apiary.trainers import TrainCall, TrainerError
from apiary.trainers import causal_lm_data as data
from apiary.trainers import causal_lm_model as lm
from apiary.trainers.causal_lm_adapter import initial_adapter, merge_adapter, write_adapter_folder
from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.trainers.causal_lm_train import config_from_env, precision, run_round
from tests.fixtures import tiny_llm

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llm.save_model(tmp_path_factory.mktemp("tiny-llama"))


def _call(tmp_path: Path, model_dir: Path, env: dict[str, Any], weights: dict[str, Any]) -> TrainCall:
    (tmp_path / "global.safetensors").write_bytes(w.dumps(weights))
    return TrainCall(module="", function="", weights_path=str(tmp_path / "global.safetensors"),
                     result_path=str(tmp_path / "result.safetensors"), out_dir=str(tmp_path / "out"), env=env,
                     dataset={"data_root": str(tiny_llm.write_shard(tmp_path / "shard"))}, round={"index": 1},
                     job={"id": "j"}, model_path=str(model_dir))


def test_a_line_of_unknown_shape_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"question": "b"}\n')

    # Execute / Assert
    with pytest.raises(TrainerError, match=r"^d\.jsonl:2: not a record of a known shape"):
        data.read_records(tmp_path)


def test_validation_split_is_seeded_and_batches_wrap_around_the_shard() -> None:
    # Execute
    train, val = data.split_validation(10, 0.2, seed=3)
    stream = data.batches(train, 3, seed=3)
    taken = [next(stream) for _ in range(6)]  # 8 records in batches of 3: three per pass

    # Assert
    assert (train, val) == data.split_validation(10, 0.2, seed=3) and len(val) == 2
    assert sorted(i for b in taken[:3] for i in b) == train == sorted(i for b in taken[3:] for i in b)
    assert data.micro_batches(8, 3, epochs=2, steps=None, accumulation=1) == 6
    assert data.micro_batches(8, 3, epochs=2, steps=5, accumulation=2) == 10


def test_config_comes_from_the_jobs_env_and_a_bad_value_is_one_line() -> None:
    assert config_from_env({"LORA_R": 4, "EPOCHS": 2, "STEPS_PER_ROUND": 3}).lora_r == 4
    with pytest.raises(TrainerError, match=r"^config is not valid for the causal_lm trainer: 1 validation error"):
        config_from_env({"LORA_R": 0})


def test_fp16_on_a_cpu_is_refused_in_one_line_and_bf16_is_autocast() -> None:
    import torch

    with pytest.raises(TrainerError, match=r"^mixed_precision fp16 is not supported on this worker's CPU"):
        precision("cpu", "fp16")
    assert precision("cpu", "bf16") is torch.bfloat16 and precision("cpu", "no") is None


def test_targets_that_match_nothing_are_named_in_one_line(model_dir: Path) -> None:
    # Prepare
    model, _ = lm.load_base(model_dir)

    # Execute / Assert
    with pytest.raises(TrainerError, match=r"^lora_target_modules \['qkv'\] match no module of this llama model"):
        lm.with_lora(model, CausalLMConfig(lora_target_modules=["q_proj", "qkv"]))


def test_a_truncated_model_file_is_one_clear_line(tmp_path: Path, model_dir: Path) -> None:
    # Prepare
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        data_ = f.read_bytes()
        (broken / f.name).write_bytes(data_[: len(data_) // 2] if f.suffix == ".safetensors" else data_)

    # Execute / Assert
    with pytest.raises(TrainerError, match=r"^base model broken cannot be loaded: "):
        lm.load_base(broken)


def test_round_0_adapter_from_the_config_alone_has_peft_keys_shapes_and_init(model_dir: Path) -> None:
    # Prepare
    model, _ = lm.load_base(model_dir)
    cfg = CausalLMConfig(lora_r=4, seed=7)
    expected = lm.adapter_tensors(lm.with_lora(model, cfg))

    # Execute
    first = initial_adapter(model.config.to_dict(), cfg)

    # Assert
    assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in expected.items()}
    assert all(not v.any() for k, v in first.items() if ".lora_B." in k)
    bound = 1 / first[next(k for k in first if ".lora_A." in k)].shape[1] ** 0.5  # kaiming(a=sqrt 5)
    assert all(v.abs().max() <= bound and v.any() for k, v in first.items() if ".lora_A." in k)
    assert all((first[k] == v).all() for k, v in initial_adapter(model.config.to_dict(), cfg).items())


def test_a_round_returns_adapter_only_tensors_that_peft_loads_from_the_folder(tmp_path: Path, model_dir: Path) -> None:
    # Prepare
    import torch
    from peft import PeftModel

    cfg = CausalLMConfig(lora_r=4, validation_split=0.25, batch_size=2)
    hf_config = lm.load_base(model_dir)[0].config.to_dict()
    start = initial_adapter(hf_config, cfg)
    env = {"LORA_R": 4, "VALIDATION_SPLIT": 0.25, "BATCH_SIZE": 2, "STEPS_PER_ROUND": 6, "LEARNING_RATE": 0.05}
    steps: list[dict[str, Any]] = []

    # Execute
    tensors, samples, metrics = run_round(_call(tmp_path, model_dir, env, start), "cpu", lambda **m: steps.append(m))
    write_adapter_folder(tensors, hf_config, cfg, tmp_path / "adapter")

    # Assert: 9 train records in batches of 2 is 5 per pass, so 6 steps wrap around
    assert set(tensors) == set(start) and samples == 9 and [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert set(metrics) == {"loss", "val_loss"}
    assert any((tensors[k] != 0).any() for k in tensors if ".lora_B." in k)
    trained = lm.with_lora(lm.load_base(model_dir)[0], cfg)
    lm.set_weights(trained, tensors, adapter=True)
    loaded = PeftModel.from_pretrained(lm.load_base(model_dir)[0], str(tmp_path / "adapter"))
    ids = torch.tensor([[6, 7, 9, 11, 6, 12]])
    with torch.no_grad():
        assert torch.allclose(trained.eval()(ids).logits, loaded.eval()(ids).logits, atol=1e-6)
        merge_adapter(model_dir, tensors, cfg, tmp_path / "merged")
        merged = lm.load_base(tmp_path / "merged")[0].eval()
        assert torch.allclose(merged(ids).logits, loaded(ids).logits, atol=1e-5)


def test_without_peft_a_round_trains_and_returns_all_weights(tmp_path: Path, model_dir: Path) -> None:
    # Prepare
    from apiary.trainers.causal_lm_adapter import initial_full_weights

    start = initial_full_weights(model_dir)
    env = {"USE_PEFT": False, "STEPS_PER_ROUND": 2, "BATCH_SIZE": 4}

    # Execute
    tensors, _, metrics = run_round(_call(tmp_path, model_dir, env, start), "cpu", lambda **m: None)

    # Assert
    assert set(tensors) == set(start) and "loss" in metrics
    assert any(not (tensors[k] == start[k]).all() for k in start)


def test_a_gguf_base_is_converted_once_into_a_read_only_folder_beside_it(tmp_path: Path, model_dir: Path) -> None:
    # Prepare: a stand-in GGUF file (the tiny llama is what reading it gives)
    import torch

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    reads: list[Path] = []

    def read(path: Path) -> tuple[Any, Any]:
        reads.append(path)
        return lm.load_base(model_dir)

    # Execute
    first = lm.hf_folder(gguf, load=read)
    again = lm.hf_folder(gguf, load=read)
    model, tokenizer = lm.load_base(gguf)  # the folder, never the stand-in file

    # Assert
    assert first == again == tmp_path / "tiny.gguf.hf" and reads == [gguf]
    assert (first / "config.json").is_file() and (first / lm.READY).is_file()
    assert all(not (p.stat().st_mode & 0o222) for p in first.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf", "tiny.gguf.hf", "tiny.gguf.hf.lock"]
    expected = lm.load_base(model_dir)[0].state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert tokenizer.eos_token == lm.load_base(model_dir)[1].eos_token


def test_the_next_round_reuses_the_childs_model_and_starts_from_the_global_weights(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    import torch

    from apiary.trainers import causal_lm_train

    hf_config = lm.load_base(model_dir)[0].config.to_dict()
    env = {"LORA_R": 2, "BATCH_SIZE": 2, "STEPS_PER_ROUND": 2, "LEARNING_RATE": 0.05}
    call = _call(tmp_path, model_dir, env, initial_adapter(hf_config, CausalLMConfig(lora_r=2)))
    (tmp_path / "r3").mkdir()
    r3 = initial_adapter(hf_config, CausalLMConfig(lora_r=3))
    other = _call(tmp_path / "r3", model_dir, {**env, "LORA_R": 3}, r3)
    loads: list[Path] = []
    load_base = lm.load_base
    monkeypatch.setattr(lm, "load_base", lambda path: loads.append(path) or load_base(path))
    monkeypatch.setattr(causal_lm_train, "_warm", {})

    # Execute: the same round twice, then one with another adapter shape
    first, _, _ = run_round(call, "cpu", lambda **m: None)
    second, _, _ = run_round(call, "cpu", lambda **m: None)
    third, _, _ = run_round(other, "cpu", lambda **m: None)

    # Assert: the kept model was reset to the round's global weights (the same round, the same result), and
    # only a new adapter shape loaded the base again
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert loads == [model_dir, model_dir]
    assert all(t.shape[0] == 3 for k, t in third.items() if ".lora_A." in k)


def test_with_scaffold_a_round_returns_the_adapters_control_variate_and_its_change(tmp_path: Path,
                                                                                   model_dir: Path) -> None:
    # Prepare: round 2 of a SCAFFOLD job, the shard's control variate and the server's given
    import torch

    from apiary.sdk import SCAFFOLD_SERVER, SCAFFOLD_STATE
    from apiary.trainers.causal_lm_train import run_round_with_state

    cfg = CausalLMConfig(lora_r=4, batch_size=2)
    start = initial_adapter(lm.load_base(model_dir)[0].config.to_dict(), cfg)
    env = {"LORA_R": 4, "BATCH_SIZE": 2, "STEPS_PER_ROUND": 3, "LEARNING_RATE": 0.05, "SCAFFOLD": "II"}
    c_i = {SCAFFOLD_STATE + k: torch.full_like(v, 0.01) for k, v in start.items()}
    c = {SCAFFOLD_SERVER + k: torch.full_like(v, 0.02) for k, v in start.items()}

    # Execute
    result, _, _ = run_round_with_state(_call(tmp_path, model_dir, env, start), "cpu", lambda **m: None,
                                        {"state": c_i, "server_state": c})

    # Assert: one control variate per adapter tensor, under the adapter's own names, moved by the round (the
    # aggregator derives its change from the shard's states: none travels with the weights)
    assert set(result["weights"]) == set(start) and "control_delta" not in result
    assert set(result["state"]) == {SCAFFOLD_STATE + k for k in start}
    assert any(bool((result["state"][k] != c_i[k]).any()) for k in c_i)


def test_a_shards_personal_layers_replace_the_global_ones_before_it_trains(tmp_path: Path, model_dir: Path) -> None:
    # Prepare: the shard kept its own lora_B of one layer last round; training barely moves it (learning rate 1e-12)
    import torch

    from apiary.shard_state import PERSONAL
    from apiary.trainers.causal_lm_train import run_round_with_state

    cfg = CausalLMConfig(lora_r=4, batch_size=2)
    start = initial_adapter(lm.load_base(model_dir)[0].config.to_dict(), cfg)
    personal = sorted(k for k in start if ".lora_B." in k)[0]
    own = torch.full_like(start[personal], 0.5)
    (tmp_path / "state.safetensors").write_bytes(w.dumps({PERSONAL + personal: own}))
    call = _call(tmp_path, model_dir, {"LORA_R": 4, "BATCH_SIZE": 2, "STEPS_PER_ROUND": 1, "LEARNING_RATE": 1e-12},
                 start)
    call.state_path, call.personal_layers = str(tmp_path / "state.safetensors"), [personal]

    # Execute
    result, _, _ = run_round_with_state(call, "cpu", lambda **m: None, {})

    # Assert
    torch.testing.assert_close(result["weights"][personal], own, rtol=0, atol=1e-6)
    assert not torch.equal(start[personal], own)
