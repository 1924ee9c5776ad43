"""The chat page ``llm-foundry serve`` answers at ``/``: ``chat.html`` beside this file, plain
HTML and JavaScript shipped in the package. Its Content-Security-Policy lets it reach this server
alone, so the page can fetch nothing from elsewhere."""

from __future__ import annotations

from importlib.resources import files

# inline script and style of the page itself; requests to this server only; nothing else
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)


def page_html() -> str:
    return files("llm_foundry.serve").joinpath("chat.html").read_text(encoding="utf-8")


def add_page(app) -> None:
    """Answer ``GET /`` on ``app`` (a FastAPI app) with the chat page (and ``HEAD /`` with its
    headers: health checkers send HEAD)."""
    from fastapi.responses import HTMLResponse

    html = page_html()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return HTMLResponse(html, headers={"Content-Security-Policy": CSP,
                                           "Cache-Control": "no-store"})  # fmt: skip
