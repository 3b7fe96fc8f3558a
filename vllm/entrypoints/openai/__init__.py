"""OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of AsyncLLM."""
