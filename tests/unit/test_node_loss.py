"""Which lost nodes count as gone: Ray's view, or a raylet that no longer accepts connections (Ray declares a node
dead only after its health checks miss, later than the survivors' failed step ends)."""

from __future__ import annotations

import socket

from orchestrator.recovery import node_loss


def _listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def _closed_port() -> int:
    with _listening() as server:
        return server.getsockname()[1]


def test_a_raylet_that_accepts_is_up_and_a_closed_port_is_down():
    with _listening() as server:
        assert not node_loss.raylet_down("127.0.0.1", server.getsockname()[1], 1.0)
    assert node_loss.raylet_down("127.0.0.1", _closed_port(), 1.0)


def test_gone_counts_nodes_ray_lists_dead_or_not_at_all_and_alive_ones_whose_raylet_refuses(monkeypatch):
    with _listening() as server:
        up = server.getsockname()[1]
        nodes = [{"NodeID": "up", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": up},
                 {"NodeID": "refusing", "Alive": True, "NodeManagerAddress": "127.0.0.1",
                  "NodeManagerPort": _closed_port()},
                 {"NodeID": "marked", "Alive": False, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": up}]
        monkeypatch.setattr(node_loss.ray, "nodes", lambda: nodes)
        assert node_loss.gone(["up", "refusing", "marked", "unknown"]) == {"refusing", "marked", "unknown"}
        assert node_loss.gone(["up"]) == set()
        assert node_loss.gone([]) == set()
