"""The rollout viewer's shelf: which samples the dashboard keeps to show whole, and for how long.

The application says how to turn one stored group record into views of its samples (the run file's
``dashboard.sample_views``, ``module:function`` that, given the run's application configuration, gives how to
get a function taking (blob key, stored bytes) and returning one JSON-ready dict per sample:
`ops.dashboard.feeds.ViewsLoader`; the RL trainer's is ``actors.sample_views:run_sample_views``), so the
dashboard reads no application record itself. A view has at least ``sample_id``, ``group_id``, ``prompt_id``,
``version`` (the newest policy version among its tokens), ``reward`` and ``passed``; the page shows whatever else it
carries (tokens with their versions and loss mask, reward components, tests, the group's advantages). A
later record of a sample (the trainer's log-probs of its tokens, once it is trained) gives a partial view,
``sample_id`` and the fields it adds, which `RolloutShelf.amend` merges into the kept sample's view.

Retention is sampled, so a week-long run holds what a short one does: the last ``keep_last`` groups, and
a reservoir of ``per_version`` groups for each policy version; past ``max_versions`` versions, every
other old version's reservoir is let go (the run stays covered end to end, more thinly further back).
Everything is in memory: a restarted dashboard starts again from the groups whose records the store
still holds when the replayed event log names them.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass
from typing import Any

SampleView = dict[str, Any]
SORTS = ("latest", "reward_high", "reward_low")


@dataclass(frozen=True)
class ShelfLimits:
    keep_last: int = 64
    per_version: int = 2
    max_versions: int = 256


class RolloutShelf:
    def __init__(self, limits: ShelfLimits = ShelfLimits(), seed: int = 0) -> None:
        self.limits = limits
        self._rng = random.Random(seed)
        self._groups: dict[str, list[SampleView]] = {}  # group id -> its sample views, kept while referenced
        self._group_of: dict[str, str] = {}  # sample id -> its kept group's id
        self._arrival: dict[str, int] = {}  # group id -> arrival number (the "latest" order)
        self._last: collections.deque[str] = collections.deque()
        self._reservoir: dict[int, list[str]] = {}  # version -> group ids sampled for it
        self._seen_per_version: collections.Counter[int] = collections.Counter()
        self._num_offered = 0
        # what the page says in place of the count while the viewer cannot fill the shelf (what it waits for, or
        # why it is off); "" once it can
        self.note = ""

    def offer(self, views: list[SampleView]) -> None:
        """One group's sample views (one record): kept if the retention rule keeps it."""
        if not views:
            return
        group_id = str(views[0]["group_id"])
        version = max(int(v.get("version", 0)) for v in views)
        self._num_offered += 1
        self._release_views(group_id)  # the same group offered again (a replayed record): its new views
        self._groups[group_id] = views
        self._group_of.update((str(v["sample_id"]), group_id) for v in views)
        self._arrival[group_id] = self._num_offered
        self._last.append(group_id)
        if len(self._last) > self.limits.keep_last:
            self._release(self._last.popleft())
        self._sample_into_reservoir(group_id, version)
        self._thin()
        if group_id not in self._last and not self._in_reservoir(group_id):
            self._release(group_id)

    def _sample_into_reservoir(self, group_id: str, version: int) -> None:
        self._seen_per_version[version] += 1
        kept = self._reservoir.setdefault(version, [])
        if len(kept) < self.limits.per_version:
            kept.append(group_id)
            return
        slot = self._rng.randrange(self._seen_per_version[version])  # reservoir sampling (Algorithm R)
        if slot < self.limits.per_version:
            evicted, kept[slot] = kept[slot], group_id
            self._release(evicted)

    def _thin(self) -> None:
        versions = sorted(self._reservoir)
        if len(versions) <= self.limits.max_versions:
            return
        for version in versions[: len(versions) // 2][1::2]:  # every other version of the older half
            for group_id in self._reservoir.pop(version):
                self._release(group_id)

    def _in_reservoir(self, group_id: str) -> bool:
        return any(group_id in ids for ids in self._reservoir.values())

    def _release(self, group_id: str) -> None:
        if group_id in self._last or self._in_reservoir(group_id):
            return  # still kept by the other rule
        self._release_views(group_id)
        self._arrival.pop(group_id, None)

    def _release_views(self, group_id: str) -> None:
        for view in self._groups.pop(group_id, ()):
            self._group_of.pop(str(view["sample_id"]), None)

    def has(self, sample_id: str) -> bool:
        """Whether the sample's view is kept (a later record of it is worth reading)."""
        return sample_id in self._group_of

    def amend(self, partial: SampleView) -> bool:
        """Merge a later record's fields into the kept view of ``partial["sample_id"]``; False when that sample
        is not kept (let go since, or never offered): nothing to add them to."""
        sample_id = str(partial["sample_id"])
        group_id = self._group_of.get(sample_id)
        if group_id is None:
            return False
        for view in self._groups[group_id]:
            if view["sample_id"] == sample_id:
                view.update({k: v for k, v in partial.items() if k not in ("sample_id", "group_id")})
        return True

    # --- what the page asks ------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def samples(self, sort: str = "latest", prompt: str = "", failed_only: bool = False,
                limit: int = 200) -> list[SampleView]:
        """Summaries (no tokens) of the kept samples, filtered and sorted."""
        if sort not in SORTS:
            raise ValueError(f"sort must be one of {SORTS}, not {sort!r}")
        rows = []
        for group_id, views in self._groups.items():
            for view in views:
                if prompt and prompt not in str(view.get("prompt_id", "")):
                    continue
                if failed_only and view.get("passed", False):
                    continue
                rows.append({k: v for k, v in view.items() if not isinstance(v, list | dict)}
                            | {"arrival": self._arrival[group_id]})
        if sort == "latest":
            rows.sort(key=lambda r: -r["arrival"])
        else:
            rows.sort(key=lambda r: float(r.get("reward", 0.0)), reverse=sort == "reward_high")
        return rows[:limit]

    def sample(self, sample_id: str) -> SampleView | None:
        """A kept sample's whole view, with its group's members (id, reward, advantage) beside it."""
        for views in self._groups.values():
            for view in views:
                if view["sample_id"] == sample_id:
                    members = [{k: v.get(k) for k in ("sample_id", "reward", "advantage", "passed")} for v in views]
                    return {**view, "group": members}
        return None
