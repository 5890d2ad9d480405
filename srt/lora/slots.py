"""Which loaded adapter sits in which slot of the weight pool.

Pinned adapters keep their slot from loading to unloading; the other slots are a least-recently-used cache
of unpinned adapters: a step that needs an adapter not in a slot takes a free slot, else evicts the
adapter that ran least recently and is not in the step. At least one slot always stays unpinned, so every
loaded adapter can run.

The invariant the scheduler keeps: the unpinned adapters of the requests running now fit the unpinned slots
(`fits`). Admission keeps it for every request it adds; a pin, which takes an unpinned slot away, keeps it
by being refused while the running requests' adapters need that slot (`can_pin`). So `place` never meets
a step that does not fit; its ValueError marks a broken invariant, not a state the server can reach.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}
        self.pinned: set[str] = set()
        self._recent: OrderedDict[str, None] = OrderedDict()  # unpinned residents, least recent first

    @property
    def used(self) -> int:
        return len(self.slot_of)

    def fits(self, names: Iterable[str]) -> bool:
        """Whether one step can serve these adapters together (pinned ones already hold their slots)."""
        return len(set(names) - self.pinned) <= self.num_slots - len(self.pinned)

    def can_pin(self, in_use: Iterable[str] = ()) -> bool:
        """Whether one more adapter can be pinned: at least one slot stays unpinned, and the unpinned adapters
        `in_use` (the running requests') still fit the unpinned slots left."""
        unpinned_left = self.num_slots - len(self.pinned) - 1
        return unpinned_left >= max(1, len(set(in_use) - self.pinned))

    def pin(self, name: str, in_use: Iterable[str] = ()) -> tuple[int, str | None]:
        """A slot held for `name` until `release`, and the adapter evicted from it (if any: never one of
        `in_use`)."""
        in_use = set(in_use)
        assert self.can_pin(in_use), "pinning a slot the running adapters or the unpinned ones need"
        placed = self.place([name], keep=in_use)
        self._recent.pop(name, None)
        self.pinned.add(name)
        return self.slot_of[name], placed[0][2] if placed else None

    def release(self, name: str) -> int | None:
        """Forget `name` (unloaded); its slot, now free, or None if it had none."""
        self.pinned.discard(name)
        self._recent.pop(name, None)
        return self.slot_of.pop(name, None)

    def place(self, names: list[str], keep: Iterable[str] = ()) -> list[tuple[str, int, str | None]]:
        """Give every adapter of a step a slot, marking them used now: (adapter, slot, evicted adapter) for
        each that was not in one, which the caller writes into the pool; neither the step's adapters nor
        `keep` are evicted. Raises ValueError when the step has more adapters than `fits` allows (admission
        must keep to it)."""
        if not self.fits(names):
            raise ValueError(
                f"a step of {len(set(names))} adapters does not fit {self.num_slots} slots "
                f"({len(self.pinned)} pinned)"
            )
        step = set(names) | set(keep)
        placed = []
        for name in names:
            if name in self.slot_of:
                if name in self._recent:
                    self._recent.move_to_end(name)
                continue
            evicted = None
            free = set(range(self.num_slots)) - set(self.slot_of.values())
            if free:
                slot = min(free)
            else:
                evicted = next(n for n in self._recent if n not in step)
                slot = self.release(evicted)
            self.slot_of[name] = slot
            self._recent[name] = None
            placed.append((name, slot, evicted))
        return placed
