"""Each device's lifecycle in the controller: member → lost → restarting → standby → member."""

from __future__ import annotations

from chameleon.runtime.control.membership import Lifecycle, Membership


def test_a_lost_device_comes_back_through_restarting_and_standby_and_joins_again():
    m = Membership(range(4))
    assert m.lose({1, 2}) == {1, 2} and set(m.members) == {0, 3}
    assert m.lose({2}) == set(), "lost twice: it was no member the second time"
    m.restart({1, 2, 3})  # 3 is a member: a returning node's start leaves it alone
    assert m.of(Lifecycle.restarting) == {1, 2} and m.is_member(3)
    assert m.back(1, 10.0) and not m.back(1, 11.0), "already on standby: its time is kept"
    assert m.standby == {1: 10.0} and m.of(Lifecycle.restarting) == {2}
    assert not m.back(0, 12.0), "a member is not back"
    assert m.join({0, 1}) == {1} and set(m.members) == {0, 1, 3} and m.standby == {}


def test_a_returning_device_that_fails_again_is_lost_not_a_member():
    m = Membership(range(2))
    m.lose({1})
    m.back(1, 5.0)
    assert m.lose({1}) == set() and m.standby == {} and m.of(Lifecycle.lost) == {1}
    assert m.back(1, 9.0) and m.standby == {1: 9.0}, "a restarted worker is back straight from lost"
