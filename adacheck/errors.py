"""One exception root for everything AdaCheck raises on purpose.

Every message says what was expected, what was found, and what the user can do.
"""


class AdaCheckError(Exception):
    """Root of all AdaCheck errors."""


class ConfigError(AdaCheckError):
    """The `adacheck` config block or a flag is invalid."""


class FormatError(AdaCheckError):
    """A checkpoint file or manifest is malformed, truncated or inconsistent."""


class IntegrityError(FormatError):
    """Stored bytes do not match the hash recorded for them."""


class NotFoundError(AdaCheckError):
    """No (complete) checkpoint where one was asked for."""


class StateError(AdaCheckError):
    """Training state cannot be captured or restored (e.g. a non-JSON-able object)."""


class DistributedError(AdaCheckError):
    """One or more ranks failed; carries every rank's cause so all ranks raise the same error."""

    def __init__(self, what: str, failures: dict):
        self.failures = dict(failures)
        lines = [f"{what} failed on {len(failures)} rank(s):"]
        for rank in sorted(failures):
            lines.append(f"  rank {rank}: {failures[rank]}")
        super().__init__("\n".join(lines))
