"""The soak's fault schedule as it runs (`FaultRunner.kinds_in_order`), without a server: a kill
whose gap has not passed waits aside while the other kinds go on, and a `restore_corruption`
that injected nothing comes back after the next kind until one has. A CI run on a loaded
machine fired the corruption once, found every target link evicted, and then sat behind a
kill gap longer than the rest of the run: the verdict failed on a fault that never got its
second try."""

from __future__ import annotations

import itertools

from benchmarks.soak.faults import KINDS, FaultRunner


class Clock:
    """What the schedule reads of a soak `Context`: its clock (and `session()`)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def session(self) -> None:
        return None


def runner(kinds: tuple[str, ...] = KINDS, kill_gap_s: float = 300.0) -> tuple[FaultRunner, Clock]:
    clock = Clock()
    r = FaultRunner(clock, seed=3, mean_gap_s=3.0, first_s=0.0, kinds=kinds, restart=None,
                    min_life_s=30.0, kill_gap_s=kill_gap_s)
    return r, clock


def drive(r: FaultRunner, clock: Clock, n: int, step_s: float = 3.0,
          injects: bool = True) -> list[tuple[float, str]]:
    """The first `n` kinds, the clock moving `step_s` per fault; a kill runs as `run` records
    it, a corruption injects when `injects`."""
    out = []
    for kind in itertools.islice(r.kinds_in_order(), n):
        out.append((clock.t, kind))
        if kind == "kill_restart":
            assert clock.t >= r._kill_due()
            r.last_kill = r.life_started = clock.t
        if kind == "restore_corruption" and injects:
            r.corruptions += 1
        clock.t += step_s
    return out


def test_a_kill_not_yet_due_lets_every_other_kind_run_first():
    r, clock = runner()
    r.last_kill = r.life_started = 0.0            # a kill just happened: the next is 300 s away
    ran = drive(r, clock, 80, step_s=10.0)
    kills = [t for t, k in ran if k == "kill_restart"]
    assert kills and kills[0] >= 300.0            # never before its gap
    before = [k for t, k in ran if t < kills[0]]
    # nothing waited behind it: every other kind took its turn more than once meanwhile
    assert {k: before.count(k) >= 2 for k in KINDS if k != "kill_restart"} == dict.fromkeys(
        set(KINDS) - {"kill_restart"}, True)
    # one kill per gap: a later round's kill while one waited is the same kill
    assert all(b - a >= 300.0 for a, b in itertools.pairwise(kills))
    # negative control: the plain rounds, a kill blocking the schedule until due, run fewer
    # than one round of faults before it
    plain = list(itertools.islice(runner()[0].schedule(), len(KINDS)))
    assert plain.index("kill_restart") < len(before) // 2


def test_a_corruption_that_injected_nothing_comes_back_after_the_next_kind():
    kinds = tuple(k for k in KINDS if k != "kill_restart")
    r, clock = runner(kinds)
    ran = [k for _, k in drive(r, clock, 2 * len(kinds), injects=False)]
    first = ran.index("restore_corruption")
    # every second fault from then on is another try, the others still take their turns
    assert ran[first::2][:5] == ["restore_corruption"] * 5
    assert {k for k in ran[first + 1::2]} - {"restore_corruption"}
    # once one injected, the schedule goes back to one per round
    r2, clock2 = runner(kinds)
    ran2 = [k for _, k in drive(r2, clock2, 3 * len(kinds), injects=True)]
    assert ran2.count("restore_corruption") == 3
    assert sorted(ran2[:len(kinds)]) == sorted(kinds)


def test_a_schedule_of_kills_only_waits_for_each_gap():
    r, clock = runner(kinds=("kill_restart",), kill_gap_s=100.0)
    # the runner's own wait (`run`) covers the gap; the schedule just hands the kill out
    kinds = r.kinds_in_order()
    assert next(kinds) == "kill_restart"
    r.last_kill = r.life_started = clock.t
    assert next(kinds) == "kill_restart"
