"""A device out of memory is one line saying what to lower (the shard fails as any other)."""

from __future__ import annotations

import pytest
import torch

from apiary.trainers import TrainerError
from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.trainers.causal_lm_train import out_of_memory_said


def test_a_gpu_out_of_memory_is_one_line_naming_what_to_lower() -> None:
    cfg = CausalLMConfig(batch_size=8, max_seq_length=512)
    with pytest.raises(TrainerError) as caught, out_of_memory_said("cuda:0", cfg):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert str(caught.value) == ("out of GPU memory on cuda:0 (batch_size 8, max_seq_length 512): lower them or use "
                                 "a larger GPU")


def test_other_errors_pass_through_unchanged() -> None:
    with pytest.raises(ValueError, match="something else"), out_of_memory_said("cuda:0", CausalLMConfig()):
        raise ValueError("something else")
