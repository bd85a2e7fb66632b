"""The cluster's network: racks and zones, and the link every KV transfer crosses.

A topology file (JSON, named by the ``topology_file`` setting or ``conductor simulate
--topology``) gives the link classes — within a rack, between racks, between zones,
each with a bandwidth, a set-up latency and a transport (RDMA or TCP) — plus optional
per-rack-pair links, each rack's zone and a static node → rack placement. A node's
rack and zone normally come from its heartbeats (``--rack``/``--zone`` on ``conductor
bridge`` and ``conductor engine``); the file's ``nodes`` fill in nodes that do not say.
Its ``capacity_groups`` name the engines that share one capacity (one device, one set of
cores): the router counts an instance's queue as its whole group's in-flight work, so
moving work between them is not mistaken for finding spare capacity.

Pure: no I/O except :func:`load_topology`, which reads one file. Without a file the
topology is :meth:`Topology.flat`: the model profile's two scalar link speeds, so
costs are exactly what they were before topologies existed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from conductor.errors import ConfigError

Transport = Literal["rdma", "tcp"]


class Link(BaseModel):
    """One class of path between two nodes. ``bandwidth_gbps`` is in gigabits per second."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bandwidth_gbps: float = Field(gt=0, le=1e6, description="achievable bandwidth of the path, Gbit/s")
    latency_us: float = Field(default=0.0, ge=0, le=1e7, description="set-up cost of one transfer, microseconds")
    transport: Transport = "rdma"

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8.0

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6

    def seconds(self, nbytes: float, read_s: float = 0.0) -> float:
        """Time to move ``nbytes`` over this path alone, streamed from a source that needs
        ``read_s`` to read them (the slower of the two legs bounds it), plus the latency."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + max(read_s, nbytes / self.bytes_per_s)


def link_from_bytes(bytes_per_s: float, latency_s: float, transport: Transport = "rdma") -> Link:
    return Link(bandwidth_gbps=bytes_per_s * 8.0 / 1e9, latency_us=latency_s * 1e6, transport=transport)


class LinkClasses(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    same_rack: Link
    cross_rack: Link
    cross_zone: Link | None = None
    """Between racks of different zones; default: ``cross_rack``."""


class RackSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    zone: str | None = Field(default=None, min_length=1, max_length=256)


class RackPair(BaseModel):
    """A dedicated path between two racks, overriding the class link."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    racks: tuple[str, str]
    link: Link

    @model_validator(mode="after")
    def _two_racks(self) -> RackPair:
        if self.racks[0] == self.racks[1]:
            raise ValueError(f"a rack pair needs two different racks, got {list(self.racks)}")
        return self


class NodePlace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rack: str | None = Field(default=None, min_length=1, max_length=256)
    zone: str | None = Field(default=None, min_length=1, max_length=256)


class Located(Protocol):
    """Anything with a node id, a rack and a zone (a policy ``Instance``, a view ``NodeState``).

    Read-only members, so frozen models and dataclasses qualify as well as plain objects."""

    @property
    def node_id(self) -> str: ...

    @property
    def rack(self) -> str | None: ...

    @property
    def zone(self) -> str | None: ...


PathKey = tuple[str, str, str]
"""Identity of a shared path: ("pair", a, b) for two nodes of one rack (their NICs),
("racks", r1, r2) for the uplink between two racks, ("zones", z1, z2) between zones."""


class Topology(BaseModel):
    """Racks, zones and the links between them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="topology", min_length=1, max_length=256)
    description: str = ""
    links: LinkClasses
    racks: dict[str, RackSpec] = Field(default_factory=dict, max_length=4096)
    rack_pairs: list[RackPair] = Field(default_factory=list, max_length=65_536)
    nodes: dict[str, NodePlace] = Field(default_factory=dict, max_length=65_536)
    capacity_groups: dict[str, list[str]] = Field(
        default_factory=dict, max_length=65_536,
        description="group name -> the nodes that share one capacity (engines on one device or one set of "
        "cores): each one's queue counts the in-flight work of the whole group",
    )
    _pairs: dict[tuple[str, str], Link] = PrivateAttr(default_factory=dict)
    _group_of: dict[str, tuple[str, ...]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _known_racks(self) -> Topology:
        if self.racks:
            for i, pair in enumerate(self.rack_pairs):
                for r in pair.racks:
                    if r not in self.racks:
                        raise ValueError(f"rack_pairs[{i}] names rack {r!r}, not among racks {sorted(self.racks)}")
        seen: set[tuple[str, str]] = set()
        for pair in self.rack_pairs:
            key = (min(pair.racks), max(pair.racks))
            if key in seen:
                raise ValueError(f"rack pair {list(key)} is given twice")
            seen.add(key)
        grouped: dict[str, str] = {}
        for name, members in self.capacity_groups.items():
            for node in members:
                other = grouped.setdefault(node, name)
                if other != name:
                    raise ValueError(f"node {node!r} is in capacity groups {other!r} and {name!r}: one at most")
        return self

    def model_post_init(self, _: object) -> None:
        self._pairs = {(min(p.racks), max(p.racks)): p.link for p in self.rack_pairs}
        self._group_of = {node: tuple(sorted(set(members)))
                          for members in self.capacity_groups.values() for node in members}

    # --- what shares capacity ----------------------------------------------------------

    def capacity_group(self, node: str) -> tuple[str, ...]:
        """The nodes sharing ``node``'s capacity, ``node`` among them, in id order (``(node,)``
        when the file puts it in no group): work queued on any of them delays all of them."""
        return self._group_of.get(node, (node,))

    @property
    def grouping(self) -> Callable[[str], tuple[str, ...]] | None:
        """:meth:`capacity_group` where the file names any group, else None (every node alone)."""
        return self.capacity_group if self.capacity_groups else None

    # --- where a node is -----------------------------------------------------------

    def place(self, node: Located) -> tuple[str | None, str | None]:
        """(rack, zone) of ``node``: its own (heartbeat) values, else the file's."""
        rack, zone = node.rack, node.zone
        if rack is None or zone is None:
            fixed = self.nodes.get(node.node_id)
            if fixed is not None:
                rack = rack if rack is not None else fixed.rack
                zone = zone if zone is not None else fixed.zone
        if zone is None and rack is not None:
            spec = self.racks.get(rack)
            if spec is not None:
                zone = spec.zone
        return rack, zone

    # --- which path a transfer takes -------------------------------------------------

    def classes(self) -> tuple[Link, ...]:
        """Every distinct link a remote transfer may use (for per-link cost tables)."""
        out: list[Link] = [self.links.same_rack, self.links.cross_rack]
        if self.links.cross_zone is not None:
            out.append(self.links.cross_zone)
        out.extend(p.link for p in self.rack_pairs)
        uniq: list[Link] = []
        for link in out:
            if link not in uniq:
                uniq.append(link)
        return tuple(uniq)

    def link_between(self, a: Located, b: Located) -> Link:
        """The path from ``a`` to ``b`` (two different nodes). Same rack (also: both racks
        unknown) → ``same_rack``; a rack pair of the file → its link; zones known and
        different → ``cross_zone``; otherwise ``cross_rack`` (also when one rack is unknown)."""
        return self._path(self.place(a), self.place(b))[1]

    def path(self, a: Located, b: Located) -> tuple[PathKey, Link]:
        """The path from ``a`` to ``b`` and its identity (transfers on one identity share it)."""
        key, link = self._path(self.place(a), self.place(b))
        if key[0] == "pair":
            x, y = sorted((a.node_id, b.node_id))
            key = ("pair", x, y)
        return key, link

    def _path(self, pa: tuple[str | None, str | None], pb: tuple[str | None, str | None]) -> tuple[PathKey, Link]:
        (ra, za), (rb, zb) = pa, pb
        if ra == rb:
            return ("pair", "", ""), self.links.same_rack
        x, y = sorted((ra or "", rb or ""))
        link = self._pairs.get((x, y))
        if link is not None:
            return ("racks", x, y), link
        if za is not None and zb is not None and za != zb and self.links.cross_zone is not None:
            z1, z2 = sorted((za, zb))
            return ("zones", z1, z2), self.links.cross_zone
        return ("racks", x, y), self.links.cross_rack

    def rack_names(self) -> list[str]:
        """Racks the file names (in ``racks`` or in ``nodes``), sorted."""
        names = set(self.racks)
        names.update(p.rack for p in self.nodes.values() if p.rack is not None)
        return sorted(names)

    @classmethod
    def flat(cls, rack_bandwidth: float, cross_rack_bandwidth: float, latency_s: float) -> Topology:
        """The two-speed network of a model profile (bytes/s), with no zones."""
        return cls(
            name="flat",
            description="the model profile's rack and cross-rack link speeds",
            links=LinkClasses(
                same_rack=link_from_bytes(rack_bandwidth, latency_s),
                cross_rack=link_from_bytes(cross_rack_bandwidth, latency_s),
            ),
        )


class _LinkSpeeds(Protocol):
    rack_bandwidth: float
    cross_rack_bandwidth: float
    transfer_latency_s: float


def flat_topology(profile: _LinkSpeeds) -> Topology:
    """:meth:`Topology.flat` of a model profile."""
    return Topology.flat(profile.rack_bandwidth, profile.cross_rack_bandwidth, profile.transfer_latency_s)


def topology_from_dict(data: object, *, source: str = "topology") -> Topology:
    """Validate a parsed topology; :class:`ConfigError` naming the first bad field."""
    try:
        return Topology.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "topology"
        raise ConfigError(f"{source}: field {where!r}: {first.get('msg')}") from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; :class:`ConfigError` naming the file and the field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"topology file {p}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"topology file {p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return topology_from_dict(data, source=f"topology file {p}")
