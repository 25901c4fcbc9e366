"""The causal-LM trainer's evaluation of a round's global model on held-out records: what a record's prompt and
expected reply are, exact match of batched greedy replies (left-padded prompts), and the round's metrics on a
tiny random llama (no download)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from apiary import weights as w
from apiary.trainers import TrainCall
from apiary.trainers import causal_lm_data as data
from apiary.trainers import causal_lm_eval as ev
from apiary.trainers import causal_lm_model as lm
from apiary.trainers.causal_lm_adapter import initial_adapter
from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.trainers.causal_lm_train import mean_loss
from tests.fixtures import tiny_llm

pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = {"prompt": "what did the cat do ?", "completion": "sat fast"}
CHAT = {"messages": [{"role": "user", "content": "what did the dog do ?"},
                     {"role": "assistant", "content": "the dog ran"}]}
TEXT = {"text": "the cat sat on the mat"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llm.save_model(tmp_path_factory.mktemp("tiny-llama"))


class ScriptedModel:
    """Stands in for a model's greedy `generate`: each prompt (by its last token) gets the reply scripted for
    it; it records the batches it was given."""

    def __init__(self, replies: dict[int, list[int]], pad: int) -> None:
        self.replies, self.pad, self.batches = replies, pad, []  # type: ignore[var-annotated]

    def eval(self) -> None:
        pass

    def generate(self, input_ids: Any, attention_mask: Any, max_new_tokens: int, **_: Any) -> Any:
        import torch

        self.batches.append((input_ids.tolist(), attention_mask.tolist(), max_new_tokens))
        rows = [self.replies[int(row[-1])][:max_new_tokens] for row in input_ids]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_a_records_prompt_and_expected_reply_by_shape() -> None:
    tok = tiny_llm.tokenizer()

    prompt, chat, text = (data.prompt_and_reply(r, tok) for r in (PROMPT, CHAT, TEXT))
    unanswered = data.prompt_and_reply({"messages": CHAT["messages"][:1]}, tok)

    assert prompt == (tok("what did the cat do ?", add_special_tokens=False)["input_ids"], "sat fast")
    assert chat is not None and chat[1] == "the dog ran"
    assert tok.decode(chat[0]) == "<user> what did the dog do ? </s> <assistant>"
    assert text is None and unanswered is None


def test_exact_match_counts_replies_equal_to_the_expected_one_from_left_padded_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: three prompts of different lengths; two answered right, one wrong
    tok = tiny_llm.tokenizer()
    ids = {word: tok.convert_tokens_to_ids(word) for word in [*tiny_llm.WORDS, "</s>"]}
    expected = [([ids["what"], ids["cat"]], "sat fast"), ([ids["dog"]], "ran"),
                ([ids["a"], ids["red"], ids["mat"]], "blue")]
    model = ScriptedModel({ids["cat"]: [ids["sat"], ids["fast"], ids["</s>"]], ids["dog"]: [ids["ran"]],
                           ids["mat"]: [ids["red"], ids["</s>"]]}, tok.pad_token_id)
    monkeypatch.setattr(ev, "GENERATION_BATCH", 2)

    # Execute
    score = ev.exact_match(model, tok, expected, "cpu")

    # Assert: 2 of 3, in batches of two, each prompt left-padded to its batch's longest
    assert score == pytest.approx(2 / 3)
    (first_ids, first_mask, first_new), (last_ids, _, _) = model.batches
    assert first_ids[1] == [tok.pad_token_id, ids["dog"]] and first_mask == [[1, 1], [0, 1]]
    assert first_new == 2 + ev.REPLY_MARGIN and last_ids == [[ids["a"], ids["red"], ids["mat"]]]


def _call(tmp_path: Path, model_dir: Path, records: list[dict[str, Any]]) -> TrainCall:
    import json

    hf_config = lm.load_base(model_dir)[0].config.to_dict()
    (tmp_path / "global.safetensors").write_bytes(w.dumps(initial_adapter(hf_config, CausalLMConfig(lora_r=2))))
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    (held_out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return TrainCall(module="", function="", weights_path=str(tmp_path / "global.safetensors"), result_path="",
                     out_dir="", env={"LORA_R": 2, "BATCH_SIZE": 2}, dataset={"data_root": str(held_out)},
                     round={"index": 0}, job={"id": "j"}, model_path=str(model_dir))


def test_a_round_is_scored_by_exact_match_and_loss_on_the_held_out_records(tmp_path: Path, model_dir: Path) -> None:
    # Prepare: the base with round 0's adapter (B is zero: the base's own replies)
    records = [PROMPT, CHAT, TEXT, PROMPT]

    # Execute
    metrics = ev.evaluate_round(_call(tmp_path, model_dir, records), "cpu")

    # Assert: the loss over every record; the exact match over the three that expect a reply, which the random
    # base, asked greedily, gets exactly as scoring its own replies says
    model, tok = lm.load_base(model_dir)
    examples = [data.encode(r, tok, 512) for r in records]
    assert metrics["val_loss"] == pytest.approx(mean_loss(model, examples, 2, "cpu", None, tok.pad_token_id), rel=1e-4)
    pairs = [p for r in records if (p := data.prompt_and_reply(r, tok)) is not None]
    assert len(pairs) == 3 and metrics["exact_match"] == ev.exact_match(model, tok, pairs, "cpu")


def test_text_records_alone_give_the_loss_and_no_exact_match(tmp_path: Path, model_dir: Path) -> None:
    metrics = ev.evaluate_round(_call(tmp_path, model_dir, [TEXT, TEXT]), "cpu")

    assert set(metrics) == {"val_loss"}
