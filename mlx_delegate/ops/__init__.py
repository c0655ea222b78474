"""Op handlers, one module per family. Importing this package registers them all."""

from . import conversion, elementwise, symbolic, attention, indexing, scatter  # noqa: F401
from . import shape, layout, creation  # noqa: F401,E402
from . import linalg, conv, pool, norm  # noqa: F401,E402
from . import activation, reduction, quant, affine  # noqa: F401,E402
