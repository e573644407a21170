"""frozen_when_loaded: collections paused during a load, the survivors frozen after it, and collections on
again either way."""

import gc

import pytest

from pagoda.process.startup_heap import frozen_when_loaded, pause_collections

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def restore_gc():
    yield
    gc.unfreeze()
    gc.enable()


def test_a_load_runs_without_collections_and_leaves_its_objects_frozen():
    gc.unfreeze()
    pause_collections()
    with frozen_when_loaded():
        assert not gc.isenabled()
        built = [{"layer": i} for i in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(built)


def test_a_failed_load_freezes_nothing_and_turns_collections_back_on():
    gc.unfreeze()
    with pytest.raises(RuntimeError), frozen_when_loaded():
        raise RuntimeError("the load failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0
