"""`rollouts.loops` exports what users compose, and every exported name resolves."""

import rollouts.loops as loops


def test_every_exported_name_resolves_from_the_package():
    for name in loops.__all__:
        assert getattr(loops, name) is not None, name
    assert "run_rl_training" in dir(loops)


def test_an_unknown_name_is_an_attribute_error():
    try:
        loops.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("no AttributeError")


def test_no_exported_name_is_shadowed_by_a_submodule_of_the_same_name():
    """Importing rollouts.loops.<x> sets the package attribute <x> to the module: an export named like
    a submodule would then resolve to the module instead of the function."""
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(loops.__path__)}
    assert not submodules & set(loops.__all__)
