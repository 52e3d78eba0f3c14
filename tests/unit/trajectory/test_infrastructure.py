"""trajectory.infrastructure: the record of an episode the infrastructure ended, on its samples."""

from __future__ import annotations

import numpy as np

from trajectory import (
    InfrastructureAbort,
    Sample,
    abort_samples,
    infrastructure_abort,
    samples_from_json,
    samples_from_safetensors,
    samples_to_json,
    samples_to_safetensors,
)
from trajectory.infrastructure import is_infrastructure_status

ENGINE_DIED = InfrastructureAbort(cause="engine_unavailable", code="engine_unavailable", status=502,
                                  message="engine unreachable", turns=2, source="server")


def _sample(status: str = "completed") -> Sample:
    mask = np.array([0, 0, 1, 1], dtype=np.uint8)
    return Sample(np.arange(4, dtype=np.int32), mask, np.where(mask == 1, -0.5, 0.0).astype(np.float32), 2, status,
                  {"num_turns": 1})


def test_aborted_samples_carry_the_record_and_nothing_else_changes() -> None:
    whole, cut = _sample(), _sample("truncated")
    out = abort_samples([whole, cut], ENGINE_DIED)
    assert [s.status for s in out] == ["aborted", "aborted"]
    assert [infrastructure_abort(s) for s in out] == [ENGINE_DIED, ENGINE_DIED]
    assert out[0].metadata == {"num_turns": 1, "abort": ENGINE_DIED.info()}
    assert (whole.status, whole.metadata) == ("completed", {"num_turns": 1})  # copies: the inputs are untouched
    np.testing.assert_array_equal(out[0].tokens, whole.tokens)
    np.testing.assert_array_equal(out[0].loss_mask, whole.loss_mask)


def test_the_first_record_is_kept() -> None:
    later = InfrastructureAbort(cause="connection", code="ConnectError", status=None, message="refused", turns=2,
                                source="client")
    (once,) = abort_samples([_sample()], ENGINE_DIED)
    (twice,) = abort_samples([once], later)
    assert infrastructure_abort(twice) == ENGINE_DIED


def test_a_sample_the_infrastructure_did_not_end_has_no_record() -> None:
    assert infrastructure_abort(_sample()) is None
    assert infrastructure_abort(_sample("truncated")) is None
    stray = _sample()
    stray.metadata["abort"] = ENGINE_DIED.info()  # a status that says otherwise wins
    assert infrastructure_abort(stray) is None


def test_the_record_survives_both_wire_encodings() -> None:
    out = abort_samples([_sample()], ENGINE_DIED)
    for decoded in (samples_from_json(samples_to_json(out)), samples_from_safetensors(samples_to_safetensors(out))):
        assert decoded[0].status == "aborted" and infrastructure_abort(decoded[0]) == ENGINE_DIED


def test_only_a_5xx_is_the_infrastructure() -> None:
    assert [is_infrastructure_status(s) for s in (200, 400, 404, 409, 499, 500, 502, 503, 504, 599)] == [
        False, False, False, False, False, True, True, True, True, True]
