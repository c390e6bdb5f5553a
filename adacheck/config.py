"""The one AdaCheck config object, validated once at start-up.

The DeepSpeed JSON block ``"adacheck": {...}`` and the Megatron ``--adacheck-*`` flags
both map onto ``AdaCheckConfig``.  Every key is checked: an unknown key, a wrong type
or an impossible value raises ConfigError naming the key and what is allowed.

Defaults (the single source of truth, also shown in configs/ and docs/deepspeed.md):

==================  ========  ==============================================================
key                 default   meaning
==================  ========  ==============================================================
enabled             false     use AdaCheck for save_checkpoint / load_checkpoint
save_dir            null      directory for checkpoints; null = the directory the training
                              script passes to save_checkpoint / load_checkpoint.  Either may
                              be an fsspec URL (s3://bucket/prefix, gs://..., file:///dir):
                              checkpoints then go to that object store or filesystem
storage_options     {}        keyword arguments for the fsspec filesystem of a URL, e.g.
                              {"endpoint_url": "http://10.0.0.5:9000", "key": ..., "secret": ...}
                              for an S3 server (s3fs); an error for a local path
async               false     save_checkpoint returns once every rank has copied its state into
                              reusable host buffers; hashing, the exchange, writing and the
                              commit run in the background (one save in flight; the next save,
                              a load and the exit wait for it).  With online deltas the base
                              checkpoints stay synchronous
async_writer        "process" where an asynchronous save's background work runs: "process"
                              (one writer process per rank, reading the snapshot through shared
                              memory; Linux, and a job that met in a TCP store, else a thread
                              with a warning) or "thread" (of the training process)
on_error            "warn"    an asynchronous save that fails in the background (full disk, lost
                              storage server): "warn" (training goes on; 'latest' is the
                              previous checkpoint) or "raise" at the next step, save or load
compression         null      "zstd": store each box as byte planes compressed with zstandard
                              (lossless; hashes, deduplication and references are those of the
                              uncompressed bytes); for storage where bandwidth is the limit
keep_last           0         keep only the newest K committed checkpoints (0 = keep all);
                              the one being written and the latest are never deleted
verify_on_load      true      check every stored box's xxh3-128 hash while loading
fsync               true      fsync files and directories while committing (switch off only
                              on storage without durability, e.g. a RAM disk for tests)
strict_objects      true      non-JSON-able client_state / scheduler entries are an error
                              (false: they are skipped with a warning)
reference_previous  true      a box whose bytes equal those of the checkpoint this job last
                              loaded (verified) or saved in the same directory is referenced
                              there, not written again (frozen layers, unchanged buffers);
                              retention keeps referenced files. false: every checkpoint
                              directory is self-contained
redundancy_factor   1         store each distinct box this many times, written by holders on
                              distinct nodes where possible ($ADACHECK_NODE or the host name);
                              a load falls back to another copy when one is damaged
exchange            "auto"    how ranks share their (box, hash) lists before a save: "ring"
                              (send to next / receive from previous, N-1 steps) or
                              "allgather" (one collective, blocks padded to the longest)
                              or "partitioned" (each tensor's shard list only to the rank that
                              decides it, one all-to-all: a rank's traffic and planning
                              follow its own boxes, not the job's size; the manifest in
                              parts, also for the memory tier's copies);
                              "auto": the ring below 32 ranks, partitioned from 32 on
hash_chunk_bytes    67108864  boxes larger than this are split along their first axis into
                              chunks with their own hash, so an unchanged part of a large
                              tensor (rows of unused tokens, a frozen slice) is referenced
                              by the next checkpoint instead of rewritten; 0 = never split
on_corrupt          "raise"   the checkpoint a load would take is damaged (a hash, header or
                              manifest check fails): "raise" an error that names the newest
                              intact checkpoint and how to load it, or "fallback": load that
                              one instead, with a warning on every rank (all ranks agree on
                              it); damaged online deltas then end the replay at the last
                              intact step instead of failing the load
takeover            false     take the save directory over from the job that holds its lease (a
                              live job saving there: its next save then fails, and 'latest'
                              stays this job's); false: a save into a directory another live
                              job owns is refused with an error naming that job
lease_ttl_s         120       a job's lease of its save directory expires this many seconds
                              after its last renewal (rank 0 renews it at every save and every
                              lease_ttl_s / 3 seconds); a job that finds another's lease expired
                              (that job died) takes the directory over without "takeover"
online              {}        online gradient deltas (below)
==================  ========  ==============================================================

``"online": {...}`` (all keys optional):

==================  ========  ==============================================================
enabled             false     after every optimizer step, store what the optimizer consumed
                              (gradients + scalars) as a delta of the last base checkpoint
base_interval       50        steps between base (full) checkpoints, or "auto": a new base
                              when the deltas since the last one cost more bytes, or more
                              estimated replay time, than a base (adacheck.online.deltas.auto_interval)
compact             false     store gradients in bf16 even when that is lossy (recovery is
                              then approximate, and says by how much: a shadow copy of the
                              optimizer state, stepped with the stored gradients, measures it)
queue_depth         2         steps whose gradients may wait for the background writer; a
                              step waits when all are in use (bounded memory)
on_error            "disable" an I/O error while writing a delta: "disable" the online mode
                              with a warning (training goes on), or "raise"
==================  ========  ==============================================================

Keys starting with ``_`` are comments (JSON has none) and are ignored.

Why hand-written dataclasses and not pydantic (which DeepSpeed uses for its own config): the
core must import with torch, safetensors, xxhash and numpy alone (the CLI, a Megatron user
without DeepSpeed), and each field's own small check says in one line which key was wrong and
what it allows ("Did you mean ...?" for an unknown key).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Optional

from .format.compression import check as check_compression
from .errors import ConfigError
from .plan.exchange import EXCHANGES

ON_ERROR = ("disable", "raise")
ON_CORRUPT = ("raise", "fallback")
ON_SAVE_ERROR = ("warn", "raise")
ASYNC_WRITERS = ("thread", "process")
# JSON keys that are Python keywords: the block's key -> the field
_ALIASES = {"async": "async_save"}


@dataclass(frozen=True)
class OnlineConfig:
    enabled: bool = False
    base_interval: object = 50          # int >= 1 or "auto"
    compact: bool = False
    queue_depth: int = 2
    on_error: str = "disable"

    def __post_init__(self):
        for key in ("enabled", "compact"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"adacheck.online.{key} must be true or false, got {getattr(self, key)!r}")
        bi = self.base_interval
        if bi != "auto" and (isinstance(bi, bool) or not isinstance(bi, int) or bi < 1):
            raise ConfigError(f"adacheck.online.base_interval must be an integer >= 1 (steps between "
                              f"base checkpoints) or \"auto\", got {bi!r}")
        q = self.queue_depth
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ConfigError(f"adacheck.online.queue_depth must be an integer >= 1, got {q!r}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"adacheck.online.on_error must be one of {', '.join(map(repr, ON_ERROR))}, "
                              f"got {self.on_error!r}")

    @classmethod
    def from_dict(cls, block) -> "OnlineConfig":
        return _section(cls, block, "adacheck.online", '{"enabled": true, "base_interval": 50}')


@dataclass(frozen=True)
class TiersConfig:
    """Checkpoint tiers (adacheck.tiers): ``memory``: every save goes to node-local memory
    (``memory_dir``, or ``$ADACHECK_MEMORY_DIR``, default /dev/shm/adacheck), keyed by the job
    (``$ADACHECK_JOB``, else torchrun's run id); every ``persist_interval``-th one is copied to the
    checkpoint directory (the durable tier) in the background, and the newest one at a clean exit;
    ``keep`` newest checkpoints stay in memory.  ``peer``: each node's memory files are copied to the
    memory of the next node too (a job across nodes then survives the loss of one)."""
    memory: bool = False
    peer: bool = False
    persist_interval: int = 1
    keep: int = 2
    memory_dir: Optional[str] = None

    def __post_init__(self):
        for key in ("memory", "peer"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"adacheck.tiers.{key} must be true or false, got {getattr(self, key)!r}")
        for key, low, what in (("persist_interval", 1, "saves between copies to durable storage"),
                               ("keep", 1, "newest checkpoints kept in memory")):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"adacheck.tiers.{key} must be an integer >= {low} ({what}), got {v!r}")
        if self.memory_dir is not None and (not isinstance(self.memory_dir, str) or not self.memory_dir):
            raise ConfigError(f"adacheck.tiers.memory_dir must be a non-empty path or null, got {self.memory_dir!r}")
        if self.peer and not self.memory:
            raise ConfigError("adacheck.tiers.peer: the peer tier copies the memory tier's files to another node's "
                              "memory; it needs tiers.memory true as well")

    @classmethod
    def from_dict(cls, block) -> "TiersConfig":
        return _section(cls, block, "adacheck.tiers", '{"memory": true, "persist_interval": 4}')


def json_object_arg(text: str) -> dict:
    """argparse ``type=`` for a flag whose value is a JSON object (``--storage-options``)."""
    import argparse
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"endpoint_url\": \"http://host:9000\"}}', "
                                         f"got {text!r}")
    return value


def _section(cls, block, where: str, example: str):
    """A section of the block (``online``, ``tiers``) as ``cls``, from its JSON object."""
    if isinstance(block, cls):
        return block
    if not isinstance(block, dict):
        raise ConfigError(f"{where} must be an object like {example}, got {type(block).__name__}: {block!r}")
    return cls(**_known(block, cls, where))


def _known(block: dict, cls, where: str) -> dict:
    known = [f.name for f in fields(cls)]
    shown = [{field: key for key, field in _ALIASES.items()}.get(n, n) for n in known]   # as the JSON spells them
    block = {k: v for k, v in block.items() if not (isinstance(k, str) and k.startswith("_"))}
    for key in block:
        if key not in known:
            close = difflib.get_close_matches(str(key), shown, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {where}.{key!r}.{hint} Allowed keys: {', '.join(shown)}")
    return block


@dataclass(frozen=True)
class AdaCheckConfig:
    enabled: bool = False
    save_dir: Optional[str] = None
    storage_options: dict = field(default_factory=dict)
    async_save: bool = False
    async_writer: str = "process"
    on_error: str = "warn"
    compression: Optional[str] = None
    keep_last: int = 0
    verify_on_load: bool = True
    fsync: bool = True
    strict_objects: bool = True
    reference_previous: bool = True
    redundancy_factor: int = 1
    exchange: str = "auto"
    hash_chunk_bytes: int = 64 << 20
    on_corrupt: str = "raise"
    takeover: bool = False
    lease_ttl_s: float = 120.0
    online: OnlineConfig = OnlineConfig()
    tiers: TiersConfig = TiersConfig()

    def __post_init__(self):
        if not isinstance(self.online, OnlineConfig):
            object.__setattr__(self, "online", OnlineConfig.from_dict(self.online))
        if not isinstance(self.tiers, TiersConfig):
            object.__setattr__(self, "tiers", TiersConfig.from_dict(self.tiers))
        for f in fields(self):
            if f.name in ("online", "tiers"):
                continue
            v = getattr(self, f.name)
            want = _TYPES[f.name]
            if f.name == "storage_options":
                if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                    raise ConfigError(f"adacheck.storage_options must be an object of fsspec filesystem "
                                      f"arguments like {{\"endpoint_url\": \"http://host:9000\"}}, got {v!r}")
                continue
            if f.name == "compression":
                check_compression(v)
                continue
            if f.name == "lease_ttl_s":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
                    raise ConfigError(f"adacheck.lease_ttl_s must be a number of seconds > 0 (how long the save "
                                      f"directory's lease outlives its owner's last renewal), got {v!r}")
                continue
            if f.name == "save_dir":
                if v is not None and (not isinstance(v, str) or not v):
                    raise ConfigError(f"adacheck.save_dir must be a non-empty path string or null, "
                                      f"got {v!r}")
                continue
            choices = {"exchange": EXCHANGES, "on_corrupt": ON_CORRUPT, "on_error": ON_SAVE_ERROR,
                       "async_writer": ASYNC_WRITERS}.get(f.name)
            if choices is not None:
                if v not in choices:
                    raise ConfigError(f"adacheck.{f.name} must be one of {', '.join(map(repr, choices))}, "
                                      f"got {v!r}")
                continue
            if want is bool and not isinstance(v, bool):
                key = next((k for k, name in _ALIASES.items() if name == f.name), f.name)
                raise ConfigError(f"adacheck.{key} must be true or false, got {v!r}")
            if want is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"adacheck.{f.name} must be an integer, got {v!r}")
        if self.redundancy_factor < 1:
            raise ConfigError(f"adacheck.redundancy_factor must be >= 1 (copies of each distinct "
                              f"box), got {self.redundancy_factor}")
        if self.hash_chunk_bytes < 0:
            raise ConfigError(f"adacheck.hash_chunk_bytes must be >= 0 (0: never split boxes), "
                              f"got {self.hash_chunk_bytes}")
        if self.storage_options and self.save_dir is not None and "://" not in self.save_dir:
            raise ConfigError(f"adacheck.storage_options apply to fsspec URLs (s3://bucket/prefix, ...), but "
                              f"adacheck.save_dir is the local path {self.save_dir!r}: remove adacheck.storage_options or "
                              "give adacheck.save_dir as a URL")
        if self.keep_last < 0:
            raise ConfigError(f"adacheck.keep_last must be >= 0 (0 keeps every checkpoint), "
                              f"got {self.keep_last}")

    @classmethod
    def from_dict(cls, block, where: str = "adacheck") -> "AdaCheckConfig":
        if block is None:
            return cls()
        if not isinstance(block, dict):
            raise ConfigError(f"the {where!r} block must be a JSON object like "
                              f'{{"enabled": true}}, got {type(block).__name__}: {block!r}')
        known = _known({_ALIASES.get(k, k): v for k, v in block.items()}, cls, where)
        return cls(**known)

    def directory(self, given, what: str, hint: str) -> str:
        """The directory ``what`` (a save, a load) uses: ``save_dir``, else ``given``, else a
        ConfigError saying where to name one (``hint``)."""
        chosen = self.save_dir or given
        if not chosen:
            raise ConfigError(f"AdaCheck {what} needs a directory: {hint}")
        return chosen

    @classmethod
    def in_config(cls, raw, framework: str) -> "AdaCheckConfig | None":
        """The validated ``"adacheck"`` block of ``framework``'s JSON config dict ``raw`` (None without
        one).  A top-level key that looks like a misspelt ``"adacheck"`` (``"adachek"``, ``"AdaCheck"``,
        ``"ada_check"``) is a ConfigError: the framework ignores unknown keys, so the block would be
        silently lost and training would go on with native checkpoints."""
        if not isinstance(raw, dict):
            return None
        for key in raw:
            if key != "adacheck" and isinstance(key, str) and (
                    "".join(c for c in key.lower() if c.isalnum()) == "adacheck"
                    or difflib.SequenceMatcher(None, key.lower(), "adacheck").ratio() >= 0.8):
                raise ConfigError(f"the {framework} config has a top-level key {key!r}; did you mean \"adacheck\"? "
                                  f"{framework} ignores unknown keys, so this block would not turn AdaCheck on. "
                                  "Rename it to \"adacheck\".")
        block = raw.get("adacheck")
        return cls.from_dict(block) if block is not None else None


_TYPES = {"enabled": bool, "save_dir": str, "storage_options": dict, "async_save": bool, "async_writer": str, "on_error": str, "compression": str, "keep_last": int, "verify_on_load": bool,
          "fsync": bool, "strict_objects": bool, "reference_previous": bool,
          "redundancy_factor": int, "exchange": str, "hash_chunk_bytes": int, "on_corrupt": str, "takeover": bool,
          "lease_ttl_s": float, "online": dict,
          "tiers": dict}
