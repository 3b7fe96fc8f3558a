"""scripts/probe_spec_step.py's phase timer wraps plain functions and classmethods
(PlanSkeleton.from_plan) alike: a wrapped classmethod still receives its class, each call is
counted under its label, and unwrapping restores the original attribute."""
from tests.utils.scripts import load_script


class _Owner:
    @classmethod
    def make(cls, value):
        return cls, value

    def twice(self, value):
        return 2 * value


def test_the_timer_keeps_classmethods_and_restores_them():
    probe = load_script("probe_spec_step.py")
    originals = dict(_Owner.__dict__)
    probe._wrap(_Owner, "make", "make")
    probe._wrap(_Owner, "twice", "twice")
    try:
        assert _Owner.make(3) == (_Owner, 3)
        assert _Owner().twice(4) == 8
        assert probe._CALLS["make"] == 1 and probe._CALLS["twice"] == 1
    finally:
        probe._unwrap()
    assert _Owner.__dict__["make"] is originals["make"]
    assert _Owner.__dict__["twice"] is originals["twice"]
