import inspect

import pytest
import trio


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run ``async def`` tests under trio (no plugin needed for so little)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        trio.run(lambda: pyfuncitem.obj(**args))
        return True
    return None
