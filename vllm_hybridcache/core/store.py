"""LinkStore: the worker-side half of the cache. Payload bytes only, no decisions.

It executes the commands the scheduler-side SnapshotTree hands out by integer link id: allocate
host buffers for a reserved link, let the model runner fill them in place, seal them, restore a
chain into caller-provided destinations, drop what the tree evicted. Each link is one contiguous
host allocation (pinned where a CUDA/ROCm device exists, so device copies can be asynchronous)
carved into typed, 64-byte aligned part tensors. A sealed link keeps one typed row tensor per
view (what restores hand out); section tensors are rebuilt on demand.

A link read from disk (`allocate(..., page_aligned=True)`) is laid out as its link file lays
out its payload instead: parts at page-aligned offsets, in a page-aligned buffer from the
store's PagePool (slabs.py: reused buffers, bounded), so the disk reader fills the whole link
with one direct read and no copy (core/linkformat/reader.py). Every other method treats both
layouts alike; a dropped staged link's buffer goes back to the pool.

Threading: a LinkStore is not thread-safe; it is called from one thread only (the model-runner
thread of its worker process). See docs/cache-core.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from .layout import StateLayout, torch_dtype
from .slabs import PAGE, Block, PageBlock, PagePool, SlabArena
from .tiers.base import LinkRef, RestorePlan

__all__ = ["LinkBuffers", "LinkStore", "MissingLinkError"]

ALIGN = 64
DEFAULT_SLAB_BYTES = 256 << 20  # power of two: torch's pinned allocator holds it exactly
# idle page-aligned buffers kept for disk reads: a 16K head's chain of qwen3-next-small (68 MB)
# several times over, or 6 links of the 38 MiB reference layout
DEFAULT_POOL_BYTES = 256 << 20

ViewSink = Callable[[str, int, torch.Tensor], None]
# What a restore reads: a RestorePlan, or just its chain (what the worker receives).
Chain = RestorePlan | Sequence[LinkRef]


class MissingLinkError(KeyError):
    """A plan names a link this store cannot restore; the adapter prefills cold.

    `link_id` names the link at fault (absent, unsealed, or holding other rows than the plan
    wants), so the adapter can have the scheduler drop it instead of offering it again; None
    when no particular link is at fault (the chain changed before the load was planned).
    """

    def __init__(self, link_id: int | None, detail: str | None = None) -> None:
        self.link_id = link_id
        self.detail = detail or (f"link {link_id} is not held" if link_id is not None
                                 else "no link to restore")
        super().__init__(self.detail)

    def __str__(self) -> str:
        return self.detail


def _chain(plan: Chain) -> tuple[LinkRef, ...]:
    return plan.chain if isinstance(plan, RestorePlan) else tuple(plan)


class LinkBuffers(NamedTuple):
    """Typed host tensors of one link, to fill in place: sections at p, view rows [start, p)."""

    sections: dict[str, torch.Tensor]
    views: dict[str, torch.Tensor]


class _Entry:
    __slots__ = ("align", "block", "buf", "nbytes", "page", "pending", "rows", "sealed",
                 "views")

    def __init__(self, buf: torch.Tensor, rows: int, block: Block | None = None,
                 page: PageBlock | None = None) -> None:
        self.buf = buf
        self.block = block  # the arena allocation to give back, when slabs are used
        self.page = page  # the pool buffer to give back (a link staged from disk)
        self.align = PAGE if page is not None else ALIGN  # part alignment inside `buf`
        self.nbytes = page.cls if page is not None else buf.numel()  # host bytes it holds
        self.rows = rows
        self.sealed = False
        # sections still to read (`LinkStore.defer`): called, and cleared, before anything
        # reads them; the views are complete
        self.pending: Callable[[], object] | None = None
        # typed row tensors of every view, built at seal: restore hands them out without
        # building views per call (one tensor object per view and link of bookkeeping)
        self.views: tuple[tuple[str, torch.Tensor], ...] = ()


def _failed() -> None:
    raise MissingLinkError(None, "its deferred sections failed to read before")


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def default_pin_memory() -> bool:
    """Pin host buffers when a CUDA or ROCm device is present (torch.cuda covers both)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


class LinkStore:
    """Worker-side payload store keyed by the tree's link ids."""

    def __init__(
        self, layout: StateLayout, pin_memory: bool | None = None, slab_bytes: int | None = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
    ) -> None:
        """pin_memory: None = pin when a CUDA/ROCm device is present. slab_bytes: carve links
        out of host slabs of this size (see slabs.py); None = DEFAULT_SLAB_BYTES when pinned
        (torch's pinned allocator would round each link up to a power of two), 0 = one exact
        allocation per link (the default unpinned: malloc does not round). pool_bytes: at most
        this many bytes of idle page-aligned buffers kept for links read from disk."""
        self.layout = layout
        self.pin_memory = default_pin_memory() if pin_memory is None else bool(pin_memory)
        if slab_bytes is None:
            slab_bytes = DEFAULT_SLAB_BYTES if self.pin_memory else 0
        self._arena = SlabArena(slab_bytes, self.pin_memory, ALIGN) if slab_bytes else None
        # a pinned store's staged links come out of its slabs too (page-aligned within them)
        self.pool = PagePool(pool_bytes, self.pin_memory, self._arena)
        self._entries: dict[int, _Entry] = {}
        self._bytes = 0
        # Fixed offsets of the sections per part alignment; views follow, sized by the link's
        # row count.
        self._secs: dict[int, list[tuple[str, int, int, torch.dtype, tuple[int, ...]]]] = {}
        self._secs_end: dict[int, int] = {}
        for a in (ALIGN, PAGE):
            secs, off = [], 0
            for s in layout.sections:
                secs.append((s.name, off, s.nbytes, torch_dtype(s.dtype), s.shape))
                off = _align(off + s.nbytes, a)
            self._secs[a], self._secs_end[a] = secs, off
        self._views = [
            (v.name, v.bytes_per_row, torch_dtype(v.dtype), v.row_shape) for v in layout.views
        ]

    # ------------------------------------------------------------------ layout of one buffer
    def _view_offsets(self, rows: int, align: int = ALIGN
                      ) -> tuple[list[tuple[str, int, int]], int]:
        off = self._secs_end[align]
        out = []
        for name, bpr, _, _ in self._views:
            out.append((name, off, bpr * rows))
            off = _align(off + bpr * rows, align)
        return out, off

    def _typed_views(self, buf: torch.Tensor, rows: int, align: int = ALIGN
                     ) -> dict[str, torch.Tensor]:
        offs, _ = self._view_offsets(rows, align)
        views = {}
        for (name, o, n), (_, _, dt, row_shape) in zip(offs, self._views, strict=True):
            views[name] = buf[o : o + n].view(dt).view(rows, *row_shape)
        return views

    def _typed(self, buf: torch.Tensor, rows: int, align: int = ALIGN) -> LinkBuffers:
        secs = {
            name: buf[o : o + n].view(dt).view(shape)
            for name, o, n, dt, shape in self._secs[align]
        }
        return LinkBuffers(secs, self._typed_views(buf, rows, align))

    # ------------------------------------------------------------------ capture
    def allocate(self, link_id: int, rows: int, page_aligned: bool = False) -> LinkBuffers:
        """Host buffers for link `link_id` holding `rows` view rows; fill them, then seal.

        page_aligned: laid out as a link file's payload (sections then views, each at a
        page-aligned offset) in a page-aligned buffer from the pool, whole pages long (see
        `payload`): what a disk read fills in one request."""
        if link_id in self._entries:
            raise ValueError(f"link {link_id} is already allocated")
        if rows < 0:
            raise ValueError("rows must be >= 0")
        if page_aligned:
            page = self.pool.take(self.staged_bytes(rows))
            self._entries[link_id] = e = _Entry(page.tensor, rows, page=page)
            self._bytes += e.nbytes
            return self._typed(page.tensor, rows, PAGE)
        _, total = self._view_offsets(rows)
        if self._arena is not None:
            block = self._arena.alloc(total)
            buf = block.tensor
            self._entries[link_id] = _Entry(buf, rows, block)
        else:
            buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=self.pin_memory)
            self._entries[link_id] = _Entry(buf, rows)
        self._bytes += buf.numel()
        return self._typed(buf, rows)

    def staged_bytes(self, rows: int) -> int:
        """The pool buffer a link of `rows` view rows staged from disk asks for
        (`allocate(page_aligned=True)`): what warming the pool for it prepares."""
        return max(self._view_offsets(rows, PAGE)[1], PAGE)

    def buffers(self, link_id: int) -> LinkBuffers:
        """Typed tensors of an allocated link (sealed or not); deferred sections (`defer`)
        are read first."""
        e = self._entries.get(link_id)
        if e is None:
            raise MissingLinkError(link_id)
        self._complete(link_id, e)
        return self._typed(e.buf, e.rows, e.align)

    def defer(self, link_id: int, complete: Callable[[], object]) -> None:
        """The link's views are filled, its sections not yet: `complete()` fills them (and
        raises if it cannot). It runs before anything reads the sections (`buffers`, a
        restore that ends at this link), once; a link dropped first never runs it.

        Why: a disk hit restores the state of its deepest link only, while every link of the
        chain is staged whole so that the promoted links can end later hits; reading the
        other links' states when (and if) one of them is needed takes about a third of a
        long chain's bytes off the hit's read (core/linkformat/reader.py)."""
        e = self._entries.get(link_id)
        if e is None:
            raise MissingLinkError(link_id)
        e.pending = complete

    def sections_pending(self, link_id: int) -> bool:
        """Whether the link's sections are still to be read (`defer`)."""
        e = self._entries.get(link_id)
        return e is not None and e.pending is not None

    def _complete(self, link_id: int, e: _Entry) -> None:
        """Run a deferred section read; a failure unseals the link (it is never restored,
        its sections never handed out) and raises MissingLinkError naming it."""
        if e.pending is None:
            return
        complete, e.pending = e.pending, None
        try:
            complete()
        except Exception as err:
            e.sealed = False
            e.pending = _failed
            raise MissingLinkError(link_id, f"link {link_id}: its sections could not be read "
                                   f"({type(err).__name__}: {err})") from err

    def payload(self, link_id: int) -> torch.Tensor:
        """The whole uint8 buffer an allocated link's parts are views of (for a page-aligned
        link: page-aligned, whole pages long, parts where its link file puts them). For the
        disk reader only: deferred sections are not read first."""
        e = self._entries.get(link_id)
        if e is None:
            raise MissingLinkError(link_id)
        return e.buf

    def seal(self, link_id: int) -> None:
        """The link is filled and its copies are complete: it may now be restored."""
        e = self._entries.get(link_id)
        if e is None:
            raise MissingLinkError(link_id)
        e.sealed = True
        e.views = tuple(self._typed_views(e.buf, e.rows, e.align).items()) if e.rows else ()

    def discard(self, link_id: int) -> None:
        """Forget a link whose fill failed (same as drop for one id)."""
        self.drop((link_id,))

    # ------------------------------------------------------------------ restore
    def _check(self, chain: tuple[LinkRef, ...]) -> list[_Entry]:
        if not chain:
            raise MissingLinkError(None, "empty restore chain")
        entries = []
        for ref in chain:
            e = self._entries.get(ref.link_id)
            if e is None or not e.sealed:
                raise MissingLinkError(ref.link_id)
            want = self.layout.view_rows(ref.start, ref.end)
            if e.rows != want:
                raise MissingLinkError(ref.link_id, f"link {ref.link_id} holds {e.rows} rows, "
                                       f"plan wants {want}")
            entries.append(e)
        return entries

    def restore(
        self,
        plan: Chain,
        section_dst: Mapping[str, torch.Tensor],
        view_sink: ViewSink,
        non_blocking: bool = False,
    ) -> int:
        """Copy the deepest link's sections into section_dst[name] and hand every link's view
        rows to view_sink. `plan` is a RestorePlan or its chain of LinkRefs (root first).

        The deepest link's sections go to section_dst[name]; every link's view
        rows to view_sink(name, start_row, rows) (a view of the stored rows, no copy), in chain
        order; start_row is ref.start // layout.view_block_tokens (a token, or a block index
        when rows are blocks; a later link's copy of a shared boundary block comes later and
        supersedes the earlier one). Every link is checked before the first byte moves, so a
        MissingLinkError leaves the destinations untouched. Returns the bytes handed over.
        """
        chain = _chain(plan)
        entries = self._check(chain)
        last = entries[-1]
        self._complete(chain[-1].link_id, last)  # the only sections a restore reads
        moved = 0
        for name, o, n, dt, shape in self._secs[last.align]:
            src = last.buf[o : o + n].view(dt).view(shape)
            section_dst[name].copy_(src, non_blocking=non_blocking)
            moved += n
        for ref, e in zip(chain, entries, strict=True):
            if e.rows == 0:
                continue
            lo = ref.start // self.layout.view_block_tokens
            for name, rows in e.views:
                view_sink(name, lo, rows)
                moved += rows.numel() * rows.element_size()
        return moved

    def restore_views_into(
        self, plan: Chain, dst: Mapping[str, torch.Tensor], non_blocking: bool = False
    ) -> int:
        """Copy every view's rows of the chain into dst[name] at row ref.start //
        view_block_tokens (dst: [n >= rows of the prefix, *row_shape]), in chain order.
        Sections are not touched. Returns the bytes copied."""
        chain = _chain(plan)
        entries = self._check(chain)
        moved = 0
        # Contiguous destinations are written as raw bytes: one slice + one copy per link and
        # view, no typed views to build (this keeps assembly close to a plain copy).
        flat: dict[str, torch.Tensor | None] = {}
        for name, _, _, _ in self._views:
            d = dst[name]
            flat[name] = d.reshape(-1).view(torch.uint8) if d.is_contiguous() else None
        if self.layout.view_block_tokens == 1 and all(f is not None for f in flat.values()):
            # Rows of consecutive links are adjacent: one torch.cat per view does every copy
            # in a single call (no per-link Python dispatch).
            srcs: dict[str, list[torch.Tensor]] = {name: [] for name, _, _, _ in self._views}
            for e in entries:
                if e.rows == 0:
                    continue
                offs, _ = self._view_offsets(e.rows, e.align)
                for name, o, n in offs:
                    srcs[name].append(e.buf[o : o + n])
                    moved += n
            start, end = chain[0].start, chain[-1].end
            for name, bpr, _, _ in self._views:
                if srcs[name]:
                    out = flat[name]
                    assert out is not None
                    torch.cat(srcs[name], out=out[start * bpr : end * bpr])
            return moved
        for ref, e in zip(chain, entries, strict=True):
            if e.rows == 0:
                continue
            lo = ref.start // self.layout.view_block_tokens  # first stored row (token/block)
            offs, _ = self._view_offsets(e.rows, e.align)
            for (name, o, n), (_, bpr, dt, row_shape) in zip(offs, self._views, strict=True):
                f = flat[name]
                if f is not None:
                    f[lo * bpr : lo * bpr + n].copy_(e.buf[o : o + n], non_blocking=non_blocking)
                else:
                    src = e.buf[o : o + n].view(dt).view(e.rows, *row_shape)
                    dst[name][lo : lo + e.rows].copy_(src, non_blocking=non_blocking)
                moved += n
        return moved

    # ------------------------------------------------------------------ housekeeping
    def drop(self, link_ids: Iterable[int]) -> int:
        """Free links the tree dropped (unknown ids are ignored). Returns bytes freed."""
        freed = 0
        for lid in link_ids:
            e = self._entries.pop(lid, None)
            if e is not None:
                freed += e.nbytes
                if e.block is not None and self._arena is not None:
                    self._arena.free(e.block)
                elif e.page is not None:
                    self.pool.give(e.page)
        self._bytes -= freed
        return freed

    def clear(self) -> int:
        n = len(self._entries)
        self._entries.clear()
        self.pool.clear()  # before the arena forgets the slabs its idle buffers lie in
        if self._arena is not None:
            self._arena.clear()
        self._bytes = 0
        return n

    @property
    def bytes_reserved(self) -> int:
        """Host bytes held for payloads: slabs plus dedicated allocations (>= bytes_held), plus
        the pool's idle buffers."""
        if self._arena is not None:  # staged links and idle pool buffers lie in its slabs
            return self._arena.reserved_bytes
        return self._bytes + self.pool.idle_bytes

    def has(self, link_id: int) -> bool:
        """Whether the link is allocated and sealed (restorable)."""
        e = self._entries.get(link_id)
        return e is not None and e.sealed

    @property
    def bytes_held(self) -> int:
        """Host bytes allocated, including alignment padding."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def padding_bytes(self, rows: int) -> int:
        """Alignment padding of one link with `rows` rows (beyond layout.link_bytes)."""
        _, total = self._view_offsets(rows)
        return max(total, 1) - self.layout.link_bytes(rows)


