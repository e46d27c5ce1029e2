"""A small MCP server on stdio (tests/test_mcp.py, docs/programs.md): `--mcp_server "python tests/mcp_calculator.py"`."""
from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def divide(a: int, b: int) -> float:
    """Divide a by b (raises on b = 0: the model reads the tool's error)."""
    return a / b


if __name__ == "__main__":
    server.run("stdio")
