"""How often a local Ray's start tries a socket that is not there yet (`ray_start.socket_polling`): every 50 ms
for Ray's own 10 s in all, unless the user has set either of Ray's two settings."""

import pytest

from rayhpc import ray_start

EVERY_MS, TRIES = "RAY_raylet_client_connect_timeout_milliseconds", "RAY_raylet_client_num_connect_attempts"


def test_sockets_are_tried_every_50_ms_for_rays_10_s_in_all(monkeypatch):
    monkeypatch.delenv(EVERY_MS, raising=False)
    monkeypatch.delenv(TRIES, raising=False)
    settings = ray_start.socket_polling()
    assert settings == {EVERY_MS: "50", TRIES: "200"}
    assert int(settings[EVERY_MS]) * int(settings[TRIES]) == 1000 * 10, "Ray's defaults: 10 tries 1000 ms apart"


@pytest.mark.parametrize("name", [EVERY_MS, TRIES])
def test_either_setting_the_user_made_wins(monkeypatch, name):
    monkeypatch.delenv(EVERY_MS, raising=False)
    monkeypatch.delenv(TRIES, raising=False)
    monkeypatch.setenv(name, "2000")
    assert ray_start.socket_polling() == {}
