"""The remaining original-surface inputs: a named error instead of a raw traceback or a silent
change (duplicate JSON keys, NaN metadata, huge counts, wrong argument types)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from echoloss import LossConfig, LossInputs, Normalizers, Sample, echo_loss_from_logprobs, pack
from echoloss.io import RolloutFileError, read_rollouts, write_rollouts
from echoloss.io.token_export import token_records
from echoloss.loss import undo_data_parallel_averaging

REC = {
    "schema_version": 1,
    "group_id": "g",
    "reward": 1.0,
    "steps": [{"prompt_ids": [1], "completion_ids": [2], "completion_logprobs": [-0.1]}],
}


def test_duplicate_json_keys_are_an_error_not_the_last_value():
    line = json.dumps(REC)[:-1] + ', "reward": 0.0}'
    with pytest.raises(RolloutFileError, match=r"line 1: invalid JSON: key 'reward' appears twice"):
        read_rollouts(io.StringIO(line + "\n"))
    nested = json.dumps({**REC, "metadata": {"a": 1}}).replace('{"a": 1}', '{"a": 1, "a": 2}')
    with pytest.raises(RolloutFileError, match="key 'a' appears twice"):
        read_rollouts(io.StringIO(nested + "\n"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_metadata_is_refused_not_written_as_null(bad):
    out = io.StringIO()
    with pytest.raises(ValueError, match=r"x\[1\] is a non-finite number"):
        write_rollouts(out, [{**REC, "metadata": {"x": [1.0, bad]}}])
    assert out.getvalue() == ""


def test_huge_normalizer_count_is_a_named_error():
    with pytest.raises(
        ValueError, match=r"Normalizers.rl_tokens must be an int in \[0, 9007199254740992\]"
    ):
        Normalizers(rl_tokens=10**30)
    Normalizers(rl_tokens=2**53)


def test_wrong_argument_types_are_named():
    with pytest.raises(TypeError, match=r"model_or_params must be a torch\.nn\.Module"):
        undo_data_parallel_averaging("x", 2)
    with pytest.raises(TypeError, match=r"model_or_params\[1\] must be a tensor"):
        undo_data_parallel_averaging([torch.zeros(1), "w"], 2)
    with pytest.raises(TypeError, match="records must be an iterable of RolloutRecord"):
        write_rollouts(io.StringIO(), REC)
    with pytest.raises(TypeError, match=r"records\[0\] must be a RolloutRecord or a dict"):
        write_rollouts(io.StringIO(), ["x"])
    s = Sample(prompt_ids=[1, 2], completion_ids=[3], completion_mask=[True],
               completion_logprobs=[-0.5], advantage=1.0)  # fmt: skip
    with pytest.raises(TypeError, match=r"batch must be an echoloss\.PackedBatch, got .*Sample"):
        token_records(s, step=0)
    with pytest.raises(TypeError, match="token_stats must be a dict"):
        token_records(pack([s], max_tokens=8)[0], step=0, token_stats="abc")


def test_custom_policy_returning_a_bare_tensor_is_named():
    lp = torch.tensor([-0.5, -1.0], requires_grad=True)
    x = LossInputs(rl_mask=torch.tensor([True, True]), advantages=torch.ones(2))
    with pytest.raises(
        TypeError, match=r"the output of policy .custom. must be an echoloss\.PolicyOutput"
    ):
        echo_loss_from_logprobs(lp, x, config=LossConfig(policy="custom"),
                                policy_fn=lambda i, c: -i.logprobs)  # fmt: skip


def test_converter_batch_is_named():
    from echoloss.adapters.convert import rllm_echo_weights

    s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_mask=[False, False],
               completion_logprobs=[0.0, 0.0], echo_weights=[None, None, 0.5, 0.5])  # fmt: skip
    with pytest.raises(TypeError, match=r"samples: expected a list of echoloss\.Sample"):
        rllm_echo_weights(s)
    assert rllm_echo_weights([s]) == [[0.0, 0.0, 0.25, 0.25]]
