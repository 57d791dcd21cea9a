"""The benchmark baselines live in the package (resgen.baselines) so that `resgen bench`
works from an installed copy; the bench scripts import them from here as before."""

from resgen.baselines import *  # noqa: F401,F403
from resgen.baselines import __all__  # noqa: F401
