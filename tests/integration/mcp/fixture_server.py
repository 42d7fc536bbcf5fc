"""An MCP server written with the official `mcp` Python SDK, for Warden's integration tests.

    python fixture_server.py            # stdio
    python fixture_server.py --http     # streamable HTTP on a free loopback port; prints
                                        # "LISTENING http://127.0.0.1:PORT/mcp" when ready

Tools: `greet` (read-only), `note` (appends a line to $NOTES_FILE: an effect the tests can
count) and `wipe` (no annotations: MCP's default, destructive).
"""

import os
import socket
import sys

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("warden-fixture", log_level="WARNING")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def greet(name: str) -> str:
    """Greets someone by name."""
    return f"hello, {name}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
def note(text: str) -> str:
    """Appends `text` to the notes file."""
    with open(os.environ["NOTES_FILE"], "a", encoding="utf-8") as f:
        f.write(text + "\n")
    return f"noted: {text}"


@server.tool()
def wipe(target: str) -> str:
    """Pretends to wipe `target` (declares nothing, so MCP's defaults say destructive)."""
    return f"wiped {target}"


def serve_http() -> None:
    import anyio
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    app = server.streamable_http_app(host="127.0.0.1")
    config = uvicorn.Config(app, log_level="warning")
    print(f"LISTENING http://127.0.0.1:{port}/mcp", flush=True)
    anyio.run(lambda: uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    if "--http" in sys.argv:
        serve_http()
    else:
        server.run("stdio")
