"""The local OpenAI-compatible endpoint, its metrics, and the backend interface it drives.

`create_app(backend)` builds the Starlette app; `serve_api(app, host, port)` runs it on
hypercorn's trio worker inside the caller's nursery. A `MeshBackend` is what the app needs of
the mesh (the daemon implements it; `LocalPipelineBackend` runs an in-process pipeline).
See docs/api.md.
"""
