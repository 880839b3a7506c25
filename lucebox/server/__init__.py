"""`lucebox serve`: an OpenAI-compatible HTTP server over one engine (starlette + uvicorn)."""
