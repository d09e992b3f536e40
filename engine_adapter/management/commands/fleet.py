"""``manage.py fleet up|down|status|restart NAME`` — run the engine fleet from its spec."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from engine_adapter import conf, services
from engine_adapter.models import EngineInstance
from engine_adapter.spec import SpecError, load_spec


class Command(BaseCommand):
    help = "Launch, stop, inspect or restart the engine fleet described by the spec file."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["up", "down", "status", "restart"])
        parser.add_argument("pool", nargs="?", help="pool name (restart, down)")
        parser.add_argument("--spec", default=None, help="fleet spec TOML (default: "
                            "$TOLLGATE_FLEET_SPEC or engine_adapter/fleets/dev.toml)")
        parser.add_argument("--sim-only", action="store_true",
                            help="launch simulated engines instead of real SGLang")
        parser.add_argument("--timeout", type=float, default=600.0)

    def handle(self, *args, action: str, pool: str | None, spec: str | None,
               sim_only: bool, timeout: float, **options) -> None:
        say = self.stdout.write
        try:
            if action == "up":
                path = spec or conf.fleet_spec_path()
                say(f"fleet spec {path}")
                services.fleet_up(spec=load_spec(path), sim_only=sim_only, timeout=timeout,
                                  progress=say)
                self._status()
            elif action == "down":
                n = services.fleet_down(pool_names=[pool] if pool else None, progress=say)
                say(f"stopped {n} engine(s)")
            elif action == "restart":
                if not pool:
                    raise CommandError("name the pool to restart: fleet restart POOL")
                services.fleet_restart(pool_name=pool, progress=say)
                self._status()
            else:
                services.fleet_health_check(restart=False)
                self._status()
        except (SpecError, TimeoutError, RuntimeError) as exc:
            raise CommandError(str(exc)) from exc

    def _status(self) -> None:
        rows = EngineInstance.objects.select_related("pool").order_by("engine_id")
        self.stdout.write(f"{'engine':<22} {'model':<26} {'region':<9} {'launch':<8} "
                          f"{'status':<10} {'run':>4} {'queue':>5}  url")
        for i in rows:
            load = i.load or {}
            self.stdout.write(
                f"{i.engine_id:<22} {i.pool.model:<26} {i.pool.region:<9} {i.pool.launch:<8} "
                f"{i.status:<10} {int(load.get('running', 0)):>4} "
                f"{int(load.get('queued', 0)):>5}  {i.url}")
