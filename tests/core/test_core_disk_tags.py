"""The disk tier on a speculative (MTP) route, without vLLM: a RAM link's draft tag travels
into its file, a restart's lookup applies the same `fits` predicate to every file of a chain
as the RAM tree does, promoted links keep their tags, and files whose tag does not fit, that
carry none, or that are of the format before tags are misses that are counted (never an
error, never a restore). The engine test on Flash-Next's MTP head is
tests/connector/test_mtp_disk.py."""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np
import pytest

from tests.core.test_core_disk_spill import DOM as SDOM
from tests.core.test_core_disk_spill import FP as SFP
from tests.core.test_core_disk_spill import TURN, Life
from tests.core.test_core_disk_tier import DOM, FP, PROMPT, Engine, _cuts, _files
from tests.keys import TEST_KEY
from vllm_hybridcache.core.disk.writer import LinkWriter
from vllm_hybridcache.core.linkformat.linkfile import (
    FORMAT_VERSION,
    LinkFileHeader,
    read_header,
)
from vllm_hybridcache.core.linkformat.reader import stage_chain
from vllm_hybridcache.core.linkformat.tags import TagCodec, UnencodableTag


class Step(NamedTuple):
    """Stands for the adapter's DraftStep: the first position of the step ending at a cut."""

    start: int


class Other(NamedTuple):
    start: int


CODEC = TagCodec({"Step": Step})


def _step_tag(c: int) -> Step:
    cuts = _cuts(PROMPT)
    i = cuts.index(c)
    return Step(cuts[i - 1] if i else 0)


def _fits(p: int, tag: object) -> bool:
    """The MTP route's predicate for PROMPT's extensions: the tag a cold prefill would keep."""
    return tag == _step_tag(p)


class TaggedEngine(Engine):
    def __init__(self, root, layout, **kw) -> None:
        super().__init__(root, layout, **kw)
        self.disk.tags = CODEC

    def capture_tagged(self, prompt: np.ndarray, tag_of, seed: int = 0) -> dict[int, int]:
        """Engine.capture with every link reserved under tag_of(cut)."""
        real = self.cache.reserve

        def reserve(kind, keys, c, domain, tag=None):
            return real(kind, keys, c, domain, tag_of(c))

        self.cache.reserve = reserve
        try:
            return self.capture(prompt, seed)
        finally:
            self.cache.reserve = real


@pytest.fixture
def tagged(tmp_path, layout):
    """A life on the MTP route that captured PROMPT (tags as a cold prefill keeps them) and
    wrote every link; its expected restore bytes."""
    e = TaggedEngine(tmp_path, layout)
    e.capture_tagged(PROMPT, _step_tag)
    e.flush()
    assert len(_files(tmp_path)) == 3
    expected = e.restore_bytes(e.tree.lookup(e.tree.keys(PROMPT), DOM, fits=_fits).plan)
    e.directory.close()
    return tmp_path, expected


def test_codec_round_trips_the_tags_of_every_route():
    for tag in (None, 7, -1, (3, 9), Step(256)):
        enc = CODEC.encode(tag)
        back = CODEC.decode(msgspec.msgpack.decode(msgspec.msgpack.encode(enc)))
        assert back == tag and type(back) is type(tag)
    for bad in (Other(1), "x", 1.5, (1, "a"), True):
        with pytest.raises(UnencodableTag):
            CODEC.encode(bad)
    # a file naming a type this engine does not know fits nothing, not even itself
    unknown = CODEC.decode(("Gone", (5,)))
    assert unknown != unknown and unknown != (5,)
    assert TagCodec().decode(("Step", (5,))) != Step(5)


def test_the_tag_is_in_the_file_and_a_restart_restores_the_same_bytes(tagged, layout):
    root, expected = tagged
    for p in _files(root):
        h, _ = read_header(p, FP, TEST_KEY)
        assert h.format == FORMAT_VERSION == 3
        assert CODEC.decode(h.tag) == _step_tag(h.end)
    e = TaggedEngine(root, layout)
    keys = e.cache.keys(np.concatenate([PROMPT, [7, 8, 9]]))
    res = e.cache.lookup(keys, DOM, len(keys) - 1, _fits)
    assert (res.hit, res.tier, res.tokens, res.shortened) == (True, "disk", 256, False)
    assert e.cache.begin_restore(res)
    stage_chain(e.store, res.plan.chain, e.cache.sources(res), FP, key=TEST_KEY)
    assert e.restore_bytes(res.plan.chain) == expected
    e.cache.end_restore(res, True, 0.01)
    # promoted with their tags: RAM serves the next lookup under the same predicate
    ram = e.tree.lookup(keys, DOM, len(keys) - 1, _fits)
    assert (ram.hit, ram.tokens, ram.shortened) == (True, 256, False)
    assert e.cache.drain_dropped() == []


def test_a_misfit_tag_ends_the_chain_and_is_counted(tmp_path, layout):
    """A file whose tag does not fit (another step start at 128) cuts the chain there, as the
    RAM tree does: 64 is served, the lookup says it was shortened at 128, the disk tier counts
    a `draft_tag` miss. Negative control of the predicate: the same files with the right tags
    serve 256 (previous test)."""
    e = TaggedEngine(tmp_path, layout)
    e.capture_tagged(PROMPT, lambda c: Step(1) if c == 128 else _step_tag(c))
    e.flush()
    e.directory.close()
    e = TaggedEngine(tmp_path, layout)
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM, None, _fits)
    assert (res.hit, res.tokens, res.shortened, res.refused) == (True, 64, True, 128)
    assert e.disk.stats().misses == {"draft_tag": 1}
    assert len(_files(tmp_path)) == 3  # refused, not deleted: it may fit another prompt


def test_untagged_files_never_serve_the_mtp_route_nor_tagged_ones_the_ar_route(tagged,
                                                                                 tmp_path,
                                                                                 layout):
    root, _ = tagged
    e = TaggedEngine(root, layout)
    assert not e.disk.lookup(e.cache.keys(PROMPT), DOM).hit           # tagged, no predicate
    ar = tmp_path / "ar"
    a = TaggedEngine(ar, layout)
    a.capture(PROMPT)                                                  # no tags
    a.flush()
    a.directory.close()
    a = TaggedEngine(ar, layout)
    res = a.cache.lookup(a.cache.keys(PROMPT), DOM, None, _fits)
    assert not res.hit and res.refused == 64        # refused at its root
    assert a.disk.stats().misses.get("draft_tag") == 1
    assert a.disk.lookup(a.cache.keys(PROMPT), DOM).hit                # its own route


def test_a_tag_no_file_can_carry_is_not_written(tmp_path, layout):
    e = TaggedEngine(tmp_path, layout)
    e.capture_tagged(PROMPT, lambda c: Other(0))
    e.flush()
    assert _files(tmp_path) == []
    assert e.disk.stats().skips.get("draft_tag") == 3


def test_files_of_the_format_before_tags_are_counted_misses(tagged, layout):
    """A format-1 file (no tag field; here with a valid CRC and MAC, so only its format is
    wrong) is refused as `format` at the start-up scan and deleted with the links above it: a
    counted miss, not an error."""
    root, _ = tagged
    p = sorted(_files(root), key=lambda q: int(q.stem.rsplit("-", 1)[1]))[0]  # the root link
    raw = p.read_bytes()
    import struct
    import zlib

    pre = struct.Struct("<8sII32s")
    magic, hlen, _, _ = pre.unpack(raw[:pre.size])
    h = msgspec.msgpack.decode(raw[pre.size:pre.size + hlen], type=LinkFileHeader)
    old = msgspec.msgpack.encode(msgspec.structs.replace(h, format=1))
    assert len(old) == hlen
    maced = struct.pack("<8sII", magic, hlen, zlib.crc32(old))
    p.write_bytes(maced + TEST_KEY.mac(maced, old) + old + raw[pre.size + hlen:])
    e = TaggedEngine(root, layout)
    assert e.directory.stats.refused == {"format": 1}
    assert _files(root) == []                      # the chain above it went with it
    res = e.cache.lookup(e.cache.keys(PROMPT), DOM, None, _fits)
    assert not res.hit
    assert e.disk.stats().misses.get("format") == 1


# ---------------------------------------------------------------- end anchors (session spill)
class Next(NamedTuple):
    """Stands for the adapter's NextToken: the token an anchor's last draft row read."""

    token: int


class Rebuilt(NamedTuple):
    """Stands for the adapter's RebuiltAnchor: a field-less marker (the anchor's boundary draft
    row is rebuilt for whatever token comes next)."""


ANCHOR_CODEC = TagCodec({"Next": Next, "Rebuilt": Rebuilt})


def _anchor_fits(prompt: np.ndarray):
    """The RAM anchor tier's predicate on the MTP route (RequestState.fits)."""
    def fits(p: int, tag: object) -> bool:
        if isinstance(tag, Next):
            return p < len(prompt) and int(prompt[p]) == tag.token
        if isinstance(tag, Rebuilt):
            return p < len(prompt)
        return False
    return fits


def _spill(tmp_path, layout, anchors) -> None:
    """One life that reserves and commits `anchors` ((tokens, tag, seed)) and drains them."""
    life = Life(tmp_path, layout, tags=ANCHOR_CODEC)
    jobs = [life.anchor(t, seed=seed, tag=tag) for t, tag, seed in anchors]
    LinkWriter(life.target).drain([(j, life.parts(j.link_id)) for j in jobs], 30.0)
    life.directory.close()


def test_codec_round_trips_the_anchor_tags_and_keeps_kinds_apart():
    for tag in (Next(7), Rebuilt(), None):
        enc = ANCHOR_CODEC.encode(tag)
        back = ANCHOR_CODEC.decode(msgspec.msgpack.decode(msgspec.msgpack.encode(enc)))
        assert back == tag and type(back) is type(tag)
    assert ANCHOR_CODEC.encode(Rebuilt()) == ("Rebuilt", ())
    # one codec per kind of file: a tree tag in an anchor file (or the other way round)
    # decodes as unknown and fits nothing
    assert ANCHOR_CODEC.decode(CODEC.encode(Step(5))) != Step(5)
    assert CODEC.decode(ANCHOR_CODEC.encode(Rebuilt())) != Rebuilt()
    with pytest.raises(UnencodableTag):
        ANCHOR_CODEC.encode(Step(1))


def test_a_tagged_anchor_is_spilled_with_its_tag_and_read_back_under_the_predicate(tmp_path,
                                                                                   layout):
    """Session spill on the MTP route: the anchor's tag is in its file's header, and the next
    life's disk anchor tier serves the next turn under the RAM anchor tier's predicate, byte
    for byte as the RAM anchor held it."""
    life = Life(tmp_path, layout, tags=ANCHOR_CODEC)
    job = life.anchor(TURN, tag=Rebuilt())
    expected = life.restore_bytes(life.ram_anchors.lookup(TURN, SDOM).plan.chain)
    LinkWriter(life.target).drain([(job, life.parts(job.link_id))], 30.0)
    life.directory.close()
    (f,) = tmp_path.rglob("a-*/*.link")
    h, _ = read_header(f, SFP, TEST_KEY)
    assert h.kind == "anchor" and ANCHOR_CODEC.decode(h.tag) == Rebuilt()
    again = Life(tmp_path, layout, tags=ANCHOR_CODEC)
    nxt = np.concatenate([TURN, [4, 5]])
    res = again.cache.lookup(nxt, SDOM, len(nxt) - 1, _anchor_fits(nxt))
    assert (res.hit, res.tier, res.kind, res.tokens) == (True, "disk", "anchor", len(TURN))
    assert again.cache.begin_restore(res)
    stage_chain(again.store, res.plan.chain, again.cache.sources(res), SFP, key=TEST_KEY)
    assert again.restore_bytes(res.plan.chain) == expected
    again.cache.end_restore(res, True, 0.01)
    again.cache.sanity_check()


def test_an_anchor_whose_tag_does_not_fit_is_a_counted_miss(tmp_path, layout):
    """Two anchor files of one conversation: the deeper one read another next token than the
    prompt has (Next), so the shallower one (a marker: fits any extension) serves; the lookup
    says it was shortened there and the disk anchor tier counts a `draft_tag` miss. The file
    stays (it fits a prompt with that token). Negative control of the predicate: that prompt
    is served from the deeper file."""
    nxt = np.concatenate([TURN, [77, 78]])
    _spill(tmp_path, layout, [(TURN[:200], Rebuilt(), 1), (TURN, Next(99), 2)])
    life = Life(tmp_path, layout, tags=ANCHOR_CODEC)
    res = life.cache.lookup(nxt, SDOM, len(nxt) - 1, _anchor_fits(nxt))
    assert (res.hit, res.kind, res.tokens, res.shortened, res.refused) == (
        True, "anchor", 200, True, len(TURN))
    assert life.disk_anchors.stats().misses == {"draft_tag": 1}
    assert len(list(tmp_path.rglob("a-*/*.link"))) == 2
    fit = np.concatenate([TURN, [99, 78]])
    assert life.cache.lookup(fit, SDOM, len(fit) - 1, _anchor_fits(fit)).tokens == len(TURN)


def test_untagged_anchors_never_serve_the_mtp_route_nor_tagged_ones_the_ar_route(tmp_path,
                                                                                  layout):
    _spill(tmp_path / "ar", layout, [(TURN, None, 0)])
    _spill(tmp_path / "mtp", layout, [(TURN, Rebuilt(), 0)])
    nxt = np.concatenate([TURN, [4]])
    ar = Life(tmp_path / "ar", layout, tags=ANCHOR_CODEC)
    mtp = Life(tmp_path / "mtp", layout, tags=ANCHOR_CODEC)
    assert not ar.cache.lookup(nxt, SDOM, len(nxt) - 1, _anchor_fits(nxt)).hit
    assert ar.disk_anchors.stats().misses == {"draft_tag": 1}
    assert not mtp.cache.lookup(nxt, SDOM, len(nxt) - 1).hit
    assert ar.cache.lookup(nxt, SDOM, len(nxt) - 1).tokens == len(TURN)         # own routes
    assert mtp.cache.lookup(nxt, SDOM, len(nxt) - 1, _anchor_fits(nxt)).tokens == len(TURN)


def test_an_anchor_tag_no_file_can_carry_is_not_spilled(tmp_path, layout):
    life = Life(tmp_path, layout, tags=ANCHOR_CODEC)
    assert life.anchor(TURN, tag=Step(0)) is None              # a tree tag type: not carried
    assert life.disk_anchors.stats().skips == {"draft_tag": 1}
    nxt = np.concatenate([TURN, [1]])
    assert life.ram_anchors.lookup(nxt, SDOM, len(nxt) - 1).tokens == len(TURN)  # RAM keeps it
