"""An organization's data-residency report for a range: its zone and what the zone allows,
where its requests ran, and the proof a compliance reviewer downloads (issue 19 item 7).

plans owns data zones; the events are metering's (read through ``metering.selectors``) and
the zones' regions are the fleet's (``engine_adapter.selectors``). Each event is judged by the
zone stored on it when it was recorded, never by the organization's current setting: a zone
changed later does not rewrite where earlier requests were allowed to run.

Rule (the same in SQL, ``usage_residency_outside``, and here, ``region_in_zone``): an event is
inside its zone when it reached no engine (region ""), when the zone is ``global`` (every
region), or when its region belongs to the zone through a pool of the fleet, including pools
since removed from the spec (past usage is judged against the pools that served it).

The digest is SHA-256 over ``digest_text``: the organization, its zone, the range, the event
and outside counts and one line per region x recorded zone, in a fixed order, without the
generation time, so the same range over the same events yields the same digest and anyone can
recompute it from the proof's own figures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from billing_platform.accounts.choices import DataZone
from billing_platform.accounts.models import Organization
from engine_adapter.selectors import zone_regions
from metering.selectors import RegionZoneCount, usage_residency_counts, usage_residency_outside

PROOF_VERSION = "tollgate-residency-proof/1"


def region_in_zone(region: str, zone: str, regions: Mapping[str, set[str]]) -> bool:
    """Return whether an event in ``region`` recorded under ``zone`` ran inside its zone."""
    return region == "" or zone == DataZone.GLOBAL or region in regions.get(zone, set())


@dataclass(frozen=True)
class RegionRow:
    """One region x recorded zone of the report, judged."""

    count: RegionZoneCount
    in_zone: bool


@dataclass(frozen=True)
class ResidencyReport:
    """An organization's residency over [start, end), UTC."""

    organization: Organization
    zone: str  # the organization's zone now (each event is judged by its own)
    start: datetime
    end: datetime
    zone_regions: dict[str, set[str]]  # every zone's regions, pools ever known
    rows: list[RegionRow]

    @property
    def allowed_regions(self) -> list[str] | None:
        """The regions the organization's zone allows; None for ``global`` (every region)."""
        if self.zone == DataZone.GLOBAL:
            return None
        return sorted(self.zone_regions.get(self.zone, set()))

    @property
    def events(self) -> int:
        return sum(r.count.events for r in self.rows)

    @property
    def outside(self) -> int:
        return sum(r.count.events for r in self.rows if not r.in_zone)

    @property
    def zones_recorded(self) -> list[str]:
        return sorted({r.count.data_zone for r in self.rows})

    def digest_text(self) -> str:
        """Return the canonical text the digest is taken over (see the module docstring)."""
        lines = [PROOF_VERSION, f"organization={self.organization.public_id}",
                 f"zone={self.zone}", f"start={self.start.isoformat()}",
                 f"end={self.end.isoformat()}", f"events={self.events}",
                 f"events_outside_zone={self.outside}"]
        lines += [f"region={r.count.region},zone_recorded={r.count.data_zone},"
                  f"events={r.count.events},prompt_tokens={r.count.prompt_tokens},"
                  f"completion_tokens={r.count.completion_tokens}"
                  for r in sorted(self.rows, key=lambda r: (r.count.region, r.count.data_zone))]
        return "\n".join(lines) + "\n"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.digest_text().encode()).hexdigest()

    def outside_events(self) -> Iterator[Mapping[str, Any]]:
        """Yield the events outside their recorded zone, in time order (streamed: a range may
        hold many). Each: request_id, event_time (datetime), region, data_zone."""
        if self.outside == 0:
            return iter(())
        return usage_residency_outside(
            org_id=self.organization.pk, start=self.start, end=self.end,
            zone_regions=self.zone_regions)


def residency_report(*, organization: Organization, start: datetime, end: datetime
                     ) -> ResidencyReport:
    """Return the residency report of ``organization``'s events in [start, end)."""
    regions = zone_regions(in_spec_only=False)
    counts = usage_residency_counts(org_id=organization.pk, start=start, end=end)
    return ResidencyReport(
        organization=organization, zone=organization.data_zone, start=start, end=end,
        zone_regions=regions,
        rows=[RegionRow(c, region_in_zone(c.region, c.data_zone, regions)) for c in counts])
