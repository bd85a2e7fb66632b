"""``conductor control ...``: change routing at run time through the ``control`` topic."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any

import typer

from conductor.cli.common import JsonLine, err, print_json, require_servers, settings_or_exit
from conductor.errors import ConductorError
from conductor.routing.control_log import current_control, publish_control
from schemas import ControlCommand

control_app = typer.Typer(
    help="Change the routing policy, its parameters, or take nodes out of rotation, at run time. "
    "Each change is a record on the control topic that every router applies in log order; "
    "decisions record the control offset they were made under (see `conductor explain`).",
    no_args_is_help=True,
)

Reason = Annotated[str, typer.Option(help="why (kept in the log)")]
PolicyName = Annotated[str, typer.Argument(help="a policy (`conductor policies`)")]
PolicyParams = Annotated[str, typer.Option(help="its parameters, a JSON object")]
ParamsArgument = Annotated[str, typer.Argument(help="a JSON object")]
NodeId = Annotated[str, typer.Argument(help="node id")]


def set_policy(name: PolicyName, params: PolicyParams = "{}", reason: Reason = "", json_out: JsonLine = False) -> None:
    """Switch every router to policy NAME with PARAMS (checked before it is published)."""
    _send({"action": "set_policy", "policy": name, "params": _params(params), "reason": reason}, json_out)


def set_params(params: ParamsArgument, reason: Reason = "", json_out: JsonLine = False) -> None:
    """Replace the current policy's parameters."""
    _send({"action": "set_params", "params": _params(params), "reason": reason}, json_out)


def node_command(action: str, doc: str) -> Callable[..., None]:
    """``conductor control ACTION NODE``: one of cordon, drain, uncordon."""

    def command(node: NodeId, reason: Reason = "", json_out: JsonLine = False) -> None:
        _send({"action": action, "node_id": node, "reason": reason}, json_out)

    command.__doc__ = doc
    return command


def show(json_out: JsonLine = False) -> None:
    """The control state every router holds once caught up with the control topic."""
    s = settings_or_exit()
    require_servers(s, kafka=True)
    st = asyncio.run(current_control(s)).as_dict()
    if json_out:
        print_json(st)
        return
    typer.echo(f"offset: {st['offset']}")
    typer.echo(f"policy: {st['policy'] or s.policy + ' (configured)'} {st['params'] if st['params'] is not None else ''}")
    typer.echo(f"cordoned: {', '.join(st['cordoned']) or '-'}")
    typer.echo(f"draining: {', '.join(st['draining']) or '-'}")
    if st["last_error"]:
        typer.echo(f"last error: {st['last_error']}")


def _send(cmd_fields: dict[str, Any], json_out: bool) -> None:
    s = settings_or_exit()
    require_servers(s, kafka=True)
    try:
        cmd = ControlCommand(**cmd_fields)
        offset = asyncio.run(publish_control(s, cmd, producer_id="conductor-cli"))
    except (ConductorError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    out = {"offset": offset, **cmd.model_dump(exclude_defaults=True)}
    print_json(out) if json_out else typer.echo(f"control offset {offset}: {cmd.action} published")


def _params(text: str) -> dict[str, Any]:
    try:
        v = json.loads(text)
    except ValueError as e:
        err.print(f"[red]error:[/red] --params is not JSON: {e}")
        raise typer.Exit(2) from None
    if not isinstance(v, dict):
        err.print("[red]error:[/red] --params must be a JSON object")
        raise typer.Exit(2)
    return v


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].add_typer(control_app, name="control")
    control_app.command("set-policy")(set_policy)
    control_app.command("set-params")(set_params)
    for action, doc in (("cordon", "Send no new requests to NODE (running ones finish)."),
                        ("drain", "Like cordon, and say the node is going away."),
                        ("uncordon", "Route to NODE again.")):
        control_app.command(action)(node_command(action, doc))
    control_app.command("show")(show)
