"""The route table: every endpoint the server serves, declared once (`api/route.py`'s
`Endpoint`), by family of routes: generation, stored objects, batches, meta.

From `ROUTES`, `api/app.py` builds the Starlette routes and the API keys' protected paths,
`api/routes/openapi.py` the OpenAPI document's operations (with their `security`), and
`api/path_errors.py` the API each path speaks (its error envelope). A new endpoint is one
`Endpoint` in its family's tuple plus its handler; a new family is one more tuple here.
"""

from __future__ import annotations

from deepinfer_server.api.route import Endpoint
from deepinfer_server.api.route_table.batches import BATCHES
from deepinfer_server.api.route_table.generation import GENERATION
from deepinfer_server.api.route_table.meta import META
from deepinfer_server.api.route_table.stored import STORED

#: Every endpoint, in the order the app matches them and the document lists them.
ROUTES: tuple[Endpoint, ...] = (*GENERATION, *STORED, *BATCHES, *META)
