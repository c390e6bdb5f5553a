"""AdaCheck's errors cross process boundaries whole: a launcher (DeepSpeed's own test harness,
torch.multiprocessing, a job scheduler's wrapper) pickles a rank's exception to its parent. The
oracle is Python's multiprocessing itself: an error raised in a worker process comes back to
the parent with the same class, message and per-rank details."""
import multiprocessing

import pytest

from adacheck.errors import ConfigError, DistributedError, IntegrityError

pytestmark = pytest.mark.unit


def _raise(kind):
    err = DistributedError.of("AdaCheck save of ck/step3 (write)",
                              {0: (kind, "rank00000-g1.safetensors: hash mismatch"), 3: (kind, "disk full")})
    err.args = (f"{err}\nCheckpoint 'step3' was not published.",)     # (as a failed save extends it)
    raise err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, also", [("IntegrityError", IntegrityError), ("ValueError", None)])
def test_distributed_errors_come_back_from_a_worker_process(kind, also):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(DistributedError) as got:
            pool.apply(_raise, (kind,))
    err = got.value
    assert err.failures == {0: "rank00000-g1.safetensors: hash mismatch", 3: "disk full"}
    assert err.kinds == {0: kind, 3: kind} and err.what == "AdaCheck save of ck/step3 (write)"
    assert str(err).endswith("Checkpoint 'step3' was not published.") and "rank 3: disk full" in str(err)
    if also is not None:       # (every failing rank raised it: still an IntegrityError)
        assert isinstance(err, also) and type(err).__name__ == "DistributedIntegrityError"
    assert not isinstance(err, ConfigError)
