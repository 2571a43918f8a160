"""A rank extension for tests (engine/tp_rank.py's protocol): it records what it sees."""


class Echo:
    def __init__(self, runner, rank: int, size: int):
        self.runner, self.rank, self.size = runner, rank, size
        self.steps = 0
        self.layers: list[int] = []
        self.attached: list = []
        self.idles = 0

    def handle(self, op: str, args: dict) -> dict:
        if op == "echo":
            return {"rank": self.rank, "size": self.size, "args": args, "steps": self.steps, "layers": self.layers,
                    "attached": self.attached, "idled": self.idles > 0, "kv_heads": self.runner.num_kv_heads,
                    "big": "x" * 5000 * self.rank}
        if op == "boom":
            raise ValueError("boom on purpose")
        raise ValueError(f"unknown op {op!r}")

    def on_step(self, attached: list):
        self.attached += attached
        self.layers = []
        return lambda layer, ready: self.layers.append(layer) if ready.query() else None

    def after_step(self) -> None:
        self.steps += 1

    def idle(self) -> None:
        self.idles += 1

    def close(self) -> None:
        pass
