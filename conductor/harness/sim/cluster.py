"""Cluster profiles: how many instances of each kind, their cache and memory sizes, the SLOs.

Profiles are JSON files named ``cluster-<name>.json`` under ``conductor/costmodel/data/``
(or any path); ``--cluster 16P8D`` overrides the instance counts of the chosen one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conductor.harness.sim.errors import SimulationError

PROFILE_DIR = Path(__file__).resolve().parents[2] / "costmodel" / "data"
DEFAULT_CLUSTER = "paper-16p8d"


class ClusterProfile(BaseModel):
    """A simulated cluster. Sizes are in KV blocks of ``block_size`` tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    model_profile: str = Field(default="llama3-70b-a800x8", description="name given to load_profile()")
    prefill_instances: int = Field(default=16, ge=1, le=4096)
    decode_instances: int = Field(default=8, ge=1, le=4096)
    block_size: int = Field(default=512, ge=1, le=4096)
    prefill_cache_blocks: int = Field(
        default=6000, ge=0, description="local KV cache of one prefill instance (host DRAM), LRU"
    )
    prefill_cache_tier: Literal["hbm", "dram"] = "dram"
    store_dram_blocks: int = Field(default=0, ge=0, description="shared pool (Mooncake Store) DRAM; 0 = no pool")
    store_ssd_blocks: int = Field(default=0, ge=0, description="the pool's SSD tier, fed by DRAM evictions")
    decode_kv_tokens: int = Field(default=1_500_000, ge=1, description="KV memory of one decode instance")
    decode_max_batch: int = Field(default=128, ge=1)
    racks: int = Field(default=1, ge=1, description="prefill/decode instances are spread round-robin over racks")
    ttft_slo_s: float = Field(default=30.0, gt=0)
    tbt_slo_ms: float = Field(default=100.0, gt=0)
    view_delay_ms: float = Field(default=20.0, ge=0, description="KV event → view propagation delay")
    default_speed: float = Field(default=1.0, gt=0, description="arrival speed-up used when --speed is not given")
    prefill_names: tuple[str, ...] = Field(default=(), description="node ids of the prefill instances "
                                           "(recorded clusters); unnamed ones are prefill-<i>")
    decode_names: tuple[str, ...] = Field(default=(), description="node ids of the decode instances")

    def prefill_name(self, i: int) -> str:
        return self.prefill_names[i] if i < len(self.prefill_names) else f"prefill-{i}"

    def decode_name(self, i: int) -> str:
        return self.decode_names[i] if i < len(self.decode_names) else f"decode-{i}"

    @property
    def has_store(self) -> bool:
        return self.store_dram_blocks > 0

    def with_counts(self, spec: str | None) -> ClusterProfile:
        """Override the instance counts from ``<P>P<D>D`` (e.g. ``16P8D``)."""
        if not spec:
            return self
        m = re.fullmatch(r"\s*(\d+)\s*[Pp]\s*(\d+)\s*[Dd]\s*", spec)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise SimulationError(f"--cluster {spec!r}: expected <prefill>P<decode>D with counts >= 1, e.g. 16P8D")
        # Other counts than the recorded ones: the names no longer describe the instances.
        return self.model_copy(update={"prefill_instances": int(m.group(1)), "decode_instances": int(m.group(2)),
                                       "prefill_names": (), "decode_names": ()})


def list_clusters() -> list[str]:
    return sorted(p.stem[len("cluster-"):] for p in PROFILE_DIR.glob("cluster-*.json"))


def load_cluster(name_or_path: str = DEFAULT_CLUSTER) -> ClusterProfile:
    """A profile by name (``conductor/costmodel/data/cluster-<name>.json``) or by file path."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.exists()):
        path = PROFILE_DIR / f"cluster-{name_or_path}.json"
        if not path.exists():
            raise SimulationError(
                f"unknown cluster profile {name_or_path!r}; known: {', '.join(list_clusters()) or '(none)'}"
            )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ClusterProfile.model_validate(data)
    except json.JSONDecodeError as e:
        raise SimulationError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        raise SimulationError(f"{path}: field {field!r}: {first.get('msg')}") from None
