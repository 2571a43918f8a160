"""Ray's token authentication for every Ray process pdserve starts or joins with.

Ray (2.5x and later) checks one shared token on every gRPC call between its processes
(GCS, raylets, core workers, drivers) when `RAY_AUTH_MODE=token`. Each process reads the
token when it starts, from `RAY_AUTH_TOKEN`, else the file `RAY_AUTH_TOKEN_PATH`, else
`~/.ray/auth_token`, and the processes it spawns inherit both variables (a raylet's
worker processes, the head's GCS). So pdserve needs no Ray API for it: it sets those
variables from the topology before it starts a head (`ray start`, the launcher), joins one
(`ray.init`: `up`, `down`, `status`, `worker`, `planner`), and the Kubernetes pods get them
from the chart (deploy/helm/pdserve). Where the token comes from:

- `ray.token_file` (resolved against the topology's directory): pdserve sets
  `RAY_AUTH_TOKEN_PATH` to it and drops `RAY_AUTH_TOKEN`, so the file wins;
- without it, Ray's own sources above; a missing token is an error naming the setting.

`ray.auth: disabled` (the default) keeps what the environment says and sets
`RAY_AUTH_MODE=disabled` only when it is unset: a new local Ray would otherwise turn token
authentication on by itself and write a token to ~/.ray, which a head started with
`ray start` on another host would not have.

The token itself is never logged or printed; only where it was read from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Mapping

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")
MIN_TOKEN_CHARS = 16  # Ray's own tokens are 64 hex digits; a short one is a typo or a placeholder


class RayAuthError(ValueError):
    """Token authentication is asked for but no usable token was found (names the setting)."""


def token_source(ray_spec, resolve: Callable[[str], Path], env: Mapping[str, str] | None = None) -> str:
    """Where a process with `env` (default: this one's) reads the Ray token from, under the
    topology's `ray` settings: "ray.token_file <path>", "RAY_AUTH_TOKEN", ...; "" when
    `auth` is disabled. RayAuthError naming the setting when there is no usable token."""
    env = os.environ if env is None else env
    if ray_spec.auth != "token":
        return ""
    if ray_spec.token_file:
        path = resolve(ray_spec.token_file)
        _check_token_file(path, "ray.token_file")
        return f"ray.token_file {path}"
    if env.get(TOKEN_ENV, "").strip():
        if len(env[TOKEN_ENV].strip()) < MIN_TOKEN_CHARS:
            raise RayAuthError(f"ray.auth: token: {TOKEN_ENV} holds fewer than {MIN_TOKEN_CHARS} characters; "
                               "use a random token (`openssl rand -hex 32 > FILE` makes one) or set ray.token_file")
        return TOKEN_ENV
    if env.get(TOKEN_PATH_ENV):
        _check_token_file(Path(env[TOKEN_PATH_ENV]).expanduser(), TOKEN_PATH_ENV)
        return f"{TOKEN_PATH_ENV} {env[TOKEN_PATH_ENV]}"
    default = DEFAULT_TOKEN_PATH.expanduser()
    if default.is_file():
        _check_token_file(default, str(DEFAULT_TOKEN_PATH))
        return str(default)
    raise RayAuthError("ray.auth: token, but no Ray token was found: set ray.token_file to a file holding it "
                       f"(`openssl rand -hex 32 > FILE` makes one), or {TOKEN_ENV} / {TOKEN_PATH_ENV}, "
                       f"or write {DEFAULT_TOKEN_PATH}")


def ray_auth_env(ray_spec, resolve: Callable[[str], Path], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables every Ray process of this topology needs (set over `env`, default this
    process's environment). Keys mapped to "" are to be removed. RayAuthError when token
    authentication is asked for and no token is found."""
    env = os.environ if env is None else env
    if ray_spec.auth != "token":
        return {MODE_ENV: env.get(MODE_ENV) or "disabled"}
    token_source(ray_spec, resolve, env)
    out = {MODE_ENV: "token"}
    if ray_spec.token_file:
        # The file must win over a token the shell happens to export (Ray reads the env first).
        out.update({TOKEN_PATH_ENV: str(resolve(ray_spec.token_file)), TOKEN_ENV: ""})
    return out


def child_env(topology, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) with the topology's Ray authentication applied: the
    environment of a Ray process pdserve starts (`ray start --head`)."""
    env = dict(os.environ if base is None else base)
    for key, value in ray_auth_env(topology.ray, topology.resolve, env).items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def apply_ray_auth(topology) -> str:
    """Set this process's environment for the topology's Ray authentication, before it
    starts or joins Ray; returns how Ray authenticates, for a log line ("token from
    ray.token_file /etc/...", "disabled"). RayAuthError naming the setting when no token."""
    before = {k: os.environ.get(k) for k in (MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV)}
    for key, value in ray_auth_env(topology.ray, topology.resolve).items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    if before != {k: os.environ.get(k) for k in before}:
        _refresh_loaded_ray()
    if topology.ray.auth != "token":
        return f"authentication {os.environ[MODE_ENV]}"
    return f"token authentication (token from {token_source(topology.ray, topology.resolve)})"


def _refresh_loaded_ray() -> None:
    """Ray's core library caches the mode and the token the first time it reads them; a
    process that loaded it before the variables were set must re-read them (what Ray's own
    `ray start` does when it turns token mode on: ray/_private/authentication)."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is None:
        return
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def _check_token_file(path: Path, setting: str) -> None:
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise RayAuthError(f"{setting}: cannot read the Ray token file {path}: {exc.strerror or exc}") from None
    if len(text) < MIN_TOKEN_CHARS:
        what = "nothing" if not text else f"fewer than {MIN_TOKEN_CHARS} characters"
        raise RayAuthError(f"{setting}: the Ray token file {path} holds {what}; write a random token there "
                           "(`openssl rand -hex 32 > FILE`)")
