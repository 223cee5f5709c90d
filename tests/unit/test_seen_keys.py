"""The exact de-duplication filter's keys on disk (`posttrain.data.seen_keys.SeenKeys`)."""

from __future__ import annotations

from posttrain.data.seen_keys import SeenKeys


def test_keys_are_seen_at_once_kept_per_part_and_forgotten_from_a_part_on(tmp_path):
    path = tmp_path / "seen.sqlite"
    seen = SeenKeys(path)
    assert seen.fresh
    seen.part = 0
    seen[b"a" * 16] = ("s", 1)
    assert seen.get(b"a" * 16) == ("s", 1) and seen.uncommitted() == {b"a" * 16: ("s", 1)}
    seen.commit()
    assert seen.uncommitted() == {} and seen.get(b"a" * 16) == ("s", 1)
    seen.part = 1
    seen.add_many([b"b" * 16, b"a" * 16], [("t", 2), ("t", 3)])
    assert seen.get(b"a" * 16) == ("s", 1)  # known already: its first origin stays
    seen.commit()
    seen.part = 2
    seen[b"c" * 16] = ("t", 4)
    seen.close()  # what was set since the last commit is kept too

    again = SeenKeys(path)
    assert not again.fresh and len(again) == 3
    again.forget_from(1)  # parts 1 and later
    assert again.get(b"a" * 16) == ("s", 1) and again.get(b"b" * 16) is None and again.get(b"c" * 16) is None
    again.close()
