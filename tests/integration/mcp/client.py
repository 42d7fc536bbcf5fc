"""Drives `warden mcp serve` with the official MCP Python client, for Warden's tests.

    python client.py stdio WARDEN_BIN       # spawns `WARDEN_BIN mcp serve` (its environment
                                            # names the mesh, tenant and token)
    python client.py http URL TOKEN         # streamable HTTP, presenting `Bearer TOKEN`

Lists the tools, then calls each tool named in the JSON array of $CALLS
(`[[name, arguments], ...]`), and prints one JSON object: {"tools": [...], "calls": [...]}
with every result as the wire shows it. A connection refused (HTTP 401) prints
{"error": "..."} instead.
"""

import asyncio
import json
import os
import sys

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client


async def session(client: Client) -> dict:
    listed = await client.list_tools()
    tools = [t.model_dump(by_alias=True, mode="json", exclude_none=True) for t in listed.tools]
    calls = []
    for name, arguments in json.loads(os.environ.get("CALLS", "[]")):
        result = await client.call_tool(name, arguments)
        calls.append(result.model_dump(by_alias=True, mode="json", exclude_none=True))
    return {"tools": tools, "calls": calls}


def describe(e: BaseException) -> str:
    """What went wrong, with exception groups (anyio's task groups) unpacked."""
    inner = getattr(e, "exceptions", None)
    if inner:
        return "; ".join(describe(x) for x in inner)
    return f"{type(e).__name__}: {e}"


async def main() -> None:
    mode = sys.argv[1]
    if mode == "stdio":
        server = StdioServerParameters(command=sys.argv[2], args=["mcp", "serve"], env=dict(os.environ))
        transport = server
    else:
        url, token = sys.argv[2], sys.argv[3]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        transport = streamable_http_client(url, http_client=httpx2.AsyncClient(headers=headers, timeout=60))
    try:
        async with Client(transport) as client:
            out = await session(client)
    except Exception as e:  # the test reads what went wrong
        out = {"error": describe(e)}
    print(json.dumps(out))


asyncio.run(main())
