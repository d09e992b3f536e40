"""Read a fleet spec file (TOML) into plain dataclasses, validating it with clear errors."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from engine_adapter.choices import Launch


class SpecError(ValueError):
    """The fleet spec is invalid; the message says where and how to fix it."""


@dataclass(frozen=True)
class PoolSpec:
    name: str
    model: str
    region: str
    zone: str
    launch: str
    model_path: str = ""
    gpu_type: str = ""
    gpu_hourly_cost: Decimal = Decimal("0")
    gpus_per_replica: int = 1
    replicas: int = 1
    engine_python: str = ""
    extra_args: tuple[str, ...] = ()
    external_urls: tuple[str, ...] = ()
    max_total_tokens: int = 8192
    vocab_size: int | None = None

    @property
    def is_embedding(self) -> bool:
        """Whether its engines serve embeddings (SGLang's ``--is-embedding``)."""
        return "--is-embedding" in self.extra_args


@dataclass(frozen=True)
class FleetSpec:
    regions: dict[str, str]
    pools: list[PoolSpec] = field(default_factory=list)


def load_spec(path: Path | str) -> FleetSpec:
    """Parse and validate the spec at ``path``."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"fleet spec {path} not found; set TOLLGATE_FLEET_SPEC") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    regions = raw.get("regions") or {}
    if not regions:
        raise SpecError(f"{path}: add a [regions] table mapping each region to a data zone")
    pools, seen = [], set()
    for n, p in enumerate(raw.get("pools") or [], start=1):
        where = f"{path}: pool #{n} ({p.get('name', '?')})"
        for key in ("name", "model", "region", "launch"):
            if not p.get(key):
                raise SpecError(f"{where}: '{key}' is required")
        if p["name"] in seen:
            raise SpecError(f"{where}: duplicate pool name")
        seen.add(p["name"])
        if p["region"] not in regions:
            raise SpecError(f"{where}: region {p['region']!r} is not in [regions]")
        if p["launch"] not in Launch.values:
            raise SpecError(f"{where}: launch must be one of {', '.join(Launch.values)}")
        if p["launch"] == Launch.EXTERNAL and not p.get("external_urls"):
            raise SpecError(f"{where}: an external pool needs external_urls")
        try:
            cost = Decimal(str(p.get("gpu_hourly_cost", "0")))
        except InvalidOperation:
            raise SpecError(f"{where}: gpu_hourly_cost must be a decimal string") from None
        pools.append(PoolSpec(
            name=p["name"], model=p["model"], region=p["region"], zone=regions[p["region"]],
            launch=p["launch"], model_path=p.get("model_path", ""),
            gpu_type=p.get("gpu_type", ""), gpu_hourly_cost=cost,
            gpus_per_replica=int(p.get("gpus_per_replica", 1)),
            replicas=int(p.get("replicas", 1)), engine_python=p.get("engine_python", ""),
            extra_args=tuple(str(a) for a in p.get("extra_args", ())),
            external_urls=tuple(p.get("external_urls", ())),
            max_total_tokens=int(p.get("max_total_tokens", 8192)),
            vocab_size=_vocab_size(p.get("vocab_size"), where),
        ))
    kinds: dict[str, set[bool]] = {}
    for pool in pools:
        kinds.setdefault(pool.model, set()).add(pool.is_embedding)
    for model, seen_kinds in kinds.items():
        if len(seen_kinds) > 1:
            raise SpecError(f"{path}: model {model!r} has pools with and without "
                            "--is-embedding; every pool of a model must serve it alike")
    return FleetSpec(regions=dict(regions), pools=pools)


def _vocab_size(value: object, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"{where}: vocab_size must be a positive integer (the model's "
                        "vocabulary: token ids a client sends must be below it)")
    return value
