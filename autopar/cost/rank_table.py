"""Clusters from MindSpore's rank table (``rank_table.json``, the cluster file HCCL reads).

A rank table lists a job's servers and, on each, its devices: the chip's physical number in its
server (``device_id``) and its rank (``rank_id``). `read_rank_table` validates one and turns it
into a `Cluster`: the device count, the servers, the mesh levels the shape implies, and the
hardware profile with its ``links`` re-derived for that shape (each level keeps the profile's
bandwidth, latency and sources). Two forms are read; numbers may be JSON strings, as HCCL writes
them, or integers; fields autopar does not need (``device_ip``, ``host_nic_ip``,
``super_device_id``, ``super_pod_list``, ``para_plane_nic_*``, ...) are ignored:

- rank table 1.0 / 1.2 (MindSpore's and CANN's current form): ``{"version": "1.0",
  "server_count": "2", "server_list": [{"server_id": ..., "device": [{"device_id": "0",
  "device_ip": ..., "rank_id": "0"}, ...]}, ...], "status": "completed"}``;
- the older form of MindSpore's first distributed-training tutorial: ``{"group_list":
  [{"server_num": "1", "device_num": "8", "instance_count": "8", "instance_list": [{"devices":
  [{"device_id": "0", "device_ip": ...}], "rank_id": "0", "server_id": ...}, ...]}], "status":
  "completed", ...}`` (a server is every instance naming its ``server_id``).

Mesh positions: rank r is mesh position r (bit 0 the fastest link, as everywhere in autopar), so
each server holds consecutive ranks, 0..m-1 on one server, m..2m-1 on the next, and so on (in
any order within the file). Inside a server, the profile's levels but the last join its devices,
fastest first; the last level joins servers. With ``ascend910`` (HCCS 2 bits, PCIe 1 bit, RoCE):
8 chips a server are HCCS 2 bits + PCIe 1 bit, 4 chips HCCS 2 bits, 2 chips HCCS 1 bit, and more
than one server adds RoCE for the remaining bits. The first level's groups are chips numbered
alike but for their low bits (HCCS: chips 0-3 and 4-7, the two groups of a server), so each run
of consecutive ranks that the first level joins must sit on chips of one group; HCCL itself runs
2- and 4-chip jobs inside one group. A profile of one level joins everything with it.

>>> from autopar.cost import load_profile
>>> table = {"version": "1.0", "server_count": "2", "status": "completed", "server_list": [
...     {"server_id": f"node_{s}", "device": [
...         {"device_id": str(d), "device_ip": f"192.168.{s}.{d}", "rank_id": str(4 * s + d)} for d in range(4)]}
...     for s in range(2)]}
>>> cluster = read_rank_table(table, load_profile("ascend910"))
>>> cluster.num_devices, cluster.num_servers, cluster.devices_per_server
(8, 2, 4)
>>> cluster.describe()
'2 servers x 4 devices; levels HCCS 2 bits (4 devices), RoCE 1 bit (8 devices)'
>>> [(level.name, level.bits) for level in cluster.profile.links]
[('HCCS', 2), ('RoCE', 62)]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from autopar.cost.profile import HardwareProfile, LinkLevel
from autopar.errors import RankTableError
from autopar.layout import is_power_of_two, mesh_bits_for
from autopar.limits import MAX_DEVICES

MAX_RANK_TABLE_BYTES = 64 << 20
"""A rank table of 65,536 devices (`MAX_DEVICES`) takes about 7 MB; a file beyond 64 MiB is not one."""

MESH_BITS = 64
"""Bits of the re-derived profile's links: the last level takes every bit the server levels leave."""


class MeshLevel(NamedTuple):
    """A link level as a cluster uses it: mesh bits ``first_bit .. first_bit + bits - 1``."""

    name: str
    first_bit: int
    bits: int

    @property
    def devices(self) -> int:
        """Devices joined by this level and the faster ones."""
        return 1 << (self.first_bit + self.bits)


@dataclass(frozen=True)
class Cluster:
    """What a rank table says: devices, servers, the mesh levels they use, and the profile re-derived for them."""

    num_devices: int
    num_servers: int
    devices_per_server: int
    levels: tuple[MeshLevel, ...]
    profile: HardwareProfile = field(repr=False)
    origin: str = "the rank table"

    @property
    def mesh_bits(self) -> int:
        return mesh_bits_for(self.num_devices)

    def describe(self) -> str:
        """One line: ``2 servers x 8 devices; levels HCCS 2 bits (4 devices), PCIe 1 bit (8 devices), RoCE ...``."""
        servers = f"{self.num_servers} server{_s(self.num_servers)}"
        shape = f"{servers} x {self.devices_per_server} device{_s(self.devices_per_server)}"
        if not self.levels:
            return f"{shape}; no links (one device)"
        levels = ", ".join(
            f"{level.name} {level.bits} bit{_s(level.bits)} ({level.devices} devices)" for level in self.levels
        )
        return f"{shape}; levels {levels}"

    def devices_for(self, requested: int | None, said_as: str = "devices=") -> int:
        """The device count: the table's, which ``requested`` (when given, as ``said_as``) must equal."""
        if requested is not None and requested != self.num_devices:
            raise RankTableError(
                f"{said_as}{requested} disagrees with {_label(self.origin, start=False)},"
                f" which describes {self.num_devices} devices; leave {said_as.strip(' =')} out or make them agree."
            )
        return self.num_devices


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def _label(origin: str, start: bool = True) -> str:
    """How a sentence names the table: ``Rank table 'path'``, or ``The rank table`` for parsed JSON."""
    label = "the rank table" if origin == "the rank table" else f"rank table {origin!r}"
    return label[:1].upper() + label[1:] if start else label


def _show(value: Any) -> str:
    """A JSON scalar as the file spells it, cut to 40 characters; an object or array by its kind."""
    if isinstance(value, dict | list):
        return _json_type(value)
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true or false", type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "a number")


@dataclass
class _Server:
    label: str
    devices: list[tuple[int, int]]  # (rank_id, device_id) in file order


class _Reader:
    """Reads one table, raising RankTableError with ``Rank table 'path': what is wrong.``"""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, problem: str) -> NoReturn:
        raise RankTableError(f"{_label(self.origin)}: {problem}.")

    def object(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(f"{where} must be a JSON object, got {_json_type(value)}")
        return value

    def array(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(f"{where} must be a JSON array, got {_json_type(value)}")
        return value

    def field(self, obj: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            self.fail(f"{where} has no {key!r}")
        return obj[key]

    def number(self, value: Any, where: str) -> int:
        """A whole number written as HCCL writes it ("3") or as a JSON integer (3)."""
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9:
            return value
        self.fail(f'{where} must be a whole number ("3" or 3), got {_show(value)}')

    def text(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            self.fail(f"{where} must be a string, got {_json_type(value)}")
        return value

    # --- the two forms --------------------------------------------------------------------------

    def servers(self, data: Mapping[str, Any]) -> list[_Server]:
        status = data.get("status")
        if status is not None and status != "completed":
            self.fail(f"its status is {_show(status)}, not 'completed' (HCCL reads a table only once it is complete)")
        if "version" in data:
            self.text(data["version"], "version")
        if "server_list" in data:
            return self.server_list(data)
        if "group_list" in data:
            return self.group_list(data)
        keys = ", ".join(repr(key) for key in list(data)[:5]) or "none"
        self.fail(
            "it has neither server_list (rank table 1.0 or 1.2) nor group_list (the older form), so it is not"
            f" a MindSpore rank table (its keys: {keys})"
        )

    def server_list(self, data: Mapping[str, Any]) -> list[_Server]:
        entries = self.array(data["server_list"], "server_list")
        device_lists = []
        for s, entry in enumerate(entries):
            where = f"server_list[{s}]"
            device_lists.append(self.array(self.field(self.object(entry, where), "device", where), f"{where}.device"))
        self.check_size(sum(len(devices) for devices in device_lists))
        if "server_count" in data:
            count = self.number(data["server_count"], "server_count")
            if count != len(entries):
                self.fail(f"server_count is {count}, but server_list lists {len(entries)} server{_s(len(entries))}")
        servers = []
        for s, (entry, devices) in enumerate(zip(entries, device_lists)):
            name = ""
            if "server_id" in entry:
                name = f" ({self.text(entry['server_id'], f'server_list[{s}].server_id')!r})"
            server = _Server(f"server {s}{name}", [])
            for d, device in enumerate(devices):
                where = f"server_list[{s}].device[{d}]"
                device = self.object(device, where)
                device_id = self.number(self.field(device, "device_id", where), f"{where}.device_id")
                rank_id = self.number(self.field(device, "rank_id", where), f"{where}.rank_id")
                server.devices.append((rank_id, device_id))
            servers.append(server)
        return servers

    def group_list(self, data: Mapping[str, Any]) -> list[_Server]:
        groups = self.array(data["group_list"], "group_list")
        if len(groups) != 1:
            self.fail(f"group_list has {len(groups)} groups; autopar reads a table of one group")
        group = self.object(groups[0], "group_list[0]")
        instances = self.array(self.field(group, "instance_list", "group_list[0]"), "group_list[0].instance_list")
        self.check_size(len(instances))
        for key in ("device_num", "instance_count"):
            if key in group:
                count = self.number(group[key], f"group_list[0].{key}")
                if count != len(instances):
                    self.fail(f"group_list[0].{key} is {count}, but instance_list lists {len(instances)} devices")
        by_id: dict[str, _Server] = {}
        for i, instance in enumerate(instances):
            where = f"group_list[0].instance_list[{i}]"
            instance = self.object(instance, where)
            rank_id = self.number(self.field(instance, "rank_id", where), f"{where}.rank_id")
            server_id = self.text(self.field(instance, "server_id", where), f"{where}.server_id")
            devices = self.array(self.field(instance, "devices", where), f"{where}.devices")
            if len(devices) != 1:
                self.fail(f"{where}.devices lists {len(devices)} devices; an instance (one process) drives one device")
            device = self.object(devices[0], f"{where}.devices[0]")
            device_id = self.number(
                self.field(device, "device_id", f"{where}.devices[0]"), f"{where}.devices[0].device_id"
            )
            server = by_id.setdefault(server_id, _Server(f"server {len(by_id)} ({server_id!r})", []))
            server.devices.append((rank_id, device_id))
        if "server_num" in group:
            count = self.number(group["server_num"], "group_list[0].server_num")
            if count != len(by_id):
                self.fail(
                    f"group_list[0].server_num is {count}, but the instances name {len(by_id)} server{_s(len(by_id))}"
                )
        return list(by_id.values())

    def check_size(self, num_devices: int) -> None:
        if num_devices > MAX_DEVICES:
            self.fail(f"it lists {num_devices:,} devices, more than autopar plans for (at most {MAX_DEVICES:,})")

    # --- from servers to a cluster --------------------------------------------------------------

    def cluster(self, servers: list[_Server], profile: HardwareProfile) -> Cluster:
        if not servers:
            self.fail("it lists no servers")
        owner: dict[int, str] = {}
        for server in servers:
            if not server.devices:
                self.fail(f"{server.label} lists no devices")
            seen: set[int] = set()
            for rank_id, device_id in server.devices:
                if device_id in seen:
                    self.fail(f"device_id {device_id} appears twice on {server.label}")
                seen.add(device_id)
                if rank_id in owner:
                    twice = f"on {owner[rank_id]} and on" if owner[rank_id] != server.label else "twice on"
                    self.fail(f"rank_id {rank_id} appears {twice} {server.label}")
                owner[rank_id] = server.label
        num_devices = len(owner)
        if max(owner) >= num_devices:
            self.fail(
                f"rank_ids must number its {num_devices} devices 0 to {num_devices - 1}, but {max(owner)} is among them"
            )
        sizes = {len(server.devices) for server in servers}
        if len(sizes) > 1:
            small = min(servers, key=lambda server: len(server.devices))
            large = max(servers, key=lambda server: len(server.devices))
            self.fail(
                f"its servers hold different numbers of devices ({len(large.devices)} on {large.label},"
                f" {len(small.devices)} on {small.label}); autopar needs the same number on every server"
            )
        per_server = sizes.pop()
        if not is_power_of_two(per_server):
            self.fail(f"each server holds {per_server} devices; autopar needs a power of two (1, 2, 4, 8, ...)")
        if not is_power_of_two(len(servers)):
            self.fail(
                f"{len(servers)} servers of {per_server} devices make {num_devices}, not a power of two;"
                " autopar needs a power of two of servers"
            )
        ordered = []  # each server's device ids in rank order, servers in rank order
        for server in sorted(servers, key=lambda server: min(server.devices)):
            ranks = sorted(server.devices)
            first, last = ranks[0][0], ranks[-1][0]
            if first % per_server or last - first != per_server - 1:
                shown = ", ".join(str(rank) for rank, _ in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
                self.fail(
                    f"{server.label} holds ranks {shown}; autopar needs each server's ranks consecutive"
                    f" (0-{per_server - 1} on one server, {per_server}-{2 * per_server - 1} on the next, ...)"
                )
            ordered.append((server.label, first, [device_id for _, device_id in ranks]))
        links = self.links(profile, ordered, per_server)
        derived = profile.model_copy(update={"links": links})
        return Cluster(
            num_devices, len(servers), per_server, _levels(links, mesh_bits_for(num_devices)), derived, self.origin
        )

    def links(
        self, profile: HardwareProfile, ordered: list[tuple[str, int, list[int]]], per_server: int
    ) -> tuple[LinkLevel, ...]:
        """The profile's levels for servers of ``per_server`` devices (checking the chips against the first level)."""
        if len(profile.links) == 1:
            return profile.links
        inner, outer = profile.links[:-1], profile.links[-1]
        server_bits = mesh_bits_for(per_server)
        capacity_bits = sum(level.bits for level in inner)
        names = ", ".join(level.name for level in inner)
        if server_bits > capacity_bits:
            self.fail(
                f"each server holds {per_server} devices, more than {profile.name}'s server levels ({names})"
                f" join ({1 << capacity_bits})"
            )
        chips_per_server, first_level = 1 << capacity_bits, inner[0]
        group, run = 1 << first_level.bits, 1 << min(first_level.bits, server_bits)
        groups = [f"{start}-{start + group - 1}" for start in range(0, chips_per_server, group)]
        named = " and ".join(groups) if len(groups) <= 2 else f"{', '.join(groups[:2])}, ..."
        for label, first_rank, device_ids in ordered:
            for device_id in device_ids:
                if device_id >= chips_per_server:
                    self.fail(
                        f"device_id {device_id} on {label} is beyond the {chips_per_server} chips of a server in"
                        f" {profile.name} (device_ids 0 to {chips_per_server - 1})"
                    )
            for start in range(0, per_server, run):
                chips = device_ids[start : start + run]
                if len({chip // group for chip in chips}) > 1:
                    self.fail(
                        f"on {label}, ranks {first_rank + start}-{first_rank + start + run - 1} sit on device_ids"
                        f" {', '.join(str(chip) for chip in chips)}, which span {first_level.name} groups"
                        f" (chips {named}); {first_level.name} joins each run of {run} consecutive ranks, so their"
                        " chips must be in one group"
                    )
        derived: list[LinkLevel] = []
        left = server_bits
        for level in inner:
            if not left:
                break
            take = min(level.bits, left)
            derived.append(level if take == level.bits else level.model_copy(update={"bits": take}))
            left -= take
        derived.append(outer.model_copy(update={"bits": MESH_BITS - server_bits}))
        return tuple(derived)


def _levels(links: tuple[LinkLevel, ...], mesh_bits: int) -> tuple[MeshLevel, ...]:
    """The levels ``mesh_bits`` bits use, fastest first."""
    levels: list[MeshLevel] = []
    first = 0
    for level in links:
        take = min(level.bits, mesh_bits - first)
        if take <= 0:
            break
        levels.append(MeshLevel(level.name, first, take))
        first += take
    return tuple(levels)


def _load(path: Path) -> Any:
    where = str(path)
    label = _label(where)
    try:
        size = path.stat().st_size
        if size > MAX_RANK_TABLE_BYTES:
            raise RankTableError(
                f"{label} has {size:,} bytes, too many for a rank table (at most {MAX_RANK_TABLE_BYTES:,})."
            )
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise RankTableError(f"{label} does not exist.") from None
    except IsADirectoryError:
        raise RankTableError(f"{label} is a directory.") from None
    except UnicodeDecodeError:
        raise RankTableError(f"{label} is not JSON (it is not UTF-8 text).") from None
    except OSError as exc:
        raise RankTableError(f"{label} cannot be read: {exc.strerror or exc}.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RankTableError(
            f"{label} is not JSON: {exc.msg.lower().removesuffix(' at')} at line {exc.lineno}, column {exc.colno}."
        ) from None
    except RecursionError:
        raise RankTableError(f"{label} is nested too deeply to be a rank table.") from None


def read_rank_table(source: str | Path | Mapping[str, Any], profile: HardwareProfile) -> Cluster:
    """The `Cluster` a rank table (a path, or its parsed JSON) describes on ``profile``; RankTableError if unusable."""
    if isinstance(source, Mapping):
        origin, data = "the rank table", source
    else:
        origin, data = str(source), _load(Path(source))
    reader = _Reader(origin)
    if not isinstance(data, Mapping):
        reader.fail(f"it is not a rank table (a JSON object is expected, got {_json_type(data)})")
    return reader.cluster(reader.servers(data), profile)
