"""CausalLMConfig: the documented keys are accepted, defaults hold, and a bad or unknown key is refused."""

import pytest
from pydantic import ValidationError

from apiary.trainers.causal_lm_config import CausalLMConfig


def test_documented_config_is_accepted() -> None:
    # Prepare
    documented = {"epochs": 3, "batch_size": 4, "learning_rate": 2e-4, "mixed_precision": "bf16",
                  "use_peft": True, "lora_r": 16, "lora_alpha": 32}

    # Execute
    cfg = CausalLMConfig.model_validate(documented)

    # Assert
    assert (cfg.epochs, cfg.lora_r, cfg.lora_alpha, cfg.mixed_precision) == (3, 16, 32, "bf16")
    assert cfg.lora_target_modules is None and cfg.merge_adapter is False


@pytest.mark.parametrize("bad", [{"lora_rr": 8}, {"mixed_precision": "fp8"}, {"lora_r": 0},
                                 {"validation_split": 1.0}, {"epochs": "many"}])
def test_bad_or_unknown_key_is_refused(bad: dict[str, object]) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ValidationError) as caught:
        CausalLMConfig.model_validate(bad)
    assert next(iter(bad)) in str(caught.value)
