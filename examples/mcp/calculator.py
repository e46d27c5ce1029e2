"""A small MCP server (stdio) for tests and the example: integer add and multiply, and a tool that raises.

    python main.py --mcp_server "python examples/mcp/calculator.py" --dataset FILE.jsonl --model PATH
"""

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def divide(a: int, b: int) -> float:
    """Divide a by b (raises on b = 0)."""
    return a / b


if __name__ == "__main__":
    server.run("stdio")
