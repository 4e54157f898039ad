"""The `tinker` section: the Tinker API served by `rlbus tinker CONFIG` (tinker_api/), for the official `tinker` SDK.

The service trains LoRA adapters on `model.path` (the base model every training client of this service shares) and
samples from the base or from saved adapters. Clients authenticate with API keys (`tml-...`) listed in `keys_file`;
each key sees only the sessions, models, futures and checkpoints it made.

    rlbus tinker configs/tinker.yaml tinker.port=8000       # then TINKER_BASE_URL=http://127.0.0.1:8000
"""

from __future__ import annotations

from rlbus.schemas.sections import _need, _Section

#: Name of the file in the run directory where the service writes its base URL (`http://host:port`).
URL_FILE = "tinker.url"
#: The prefix the SDK requires of an API key (it refuses any other before sending a request).
KEY_PREFIX = "tml-"


class TinkerConfig(_Section):
    host: str = "127.0.0.1"  # where the service listens; loopback unless you mean otherwise
    port: int = 0  # its port; 0 = a free one (<run_dir>/tinker.url says which)
    dir: str = ""  # where saved states and sampler weights live; "" = <run_dir>/tinker
    keys_file: str = ""  # API keys, one `tml-...` per line, mode 0600; "" = <run_dir>/creds/tinker_keys (made once)
    base_model: str = ""  # the name clients pass as base_model; "" = model.path, absolute (get_tokenizer loads it)
    lora_alpha: float = 32.0  # LoRA scale numerator: an adapter of rank r adds (lora_alpha / r) B A x
    max_lora_rank: int = 128  # the largest rank a training client may ask for
    max_models: int = 8  # training models held at once, all keys together (each holds its adapter and AdamW)
    max_samplers: int = 4  # sets of sampler weights kept loaded (least recently used dropped, reloaded on demand)
    max_batch_size: int = 16  # sequences a sampler generates in one batch
    max_tokens: int = 1024  # the most tokens one sample request may ask for (max_tokens; and its default)
    poll_s: float = 20.0  # a retrieve_future waits this long for its result before answering "try again"
    future_ttl_s: float = 600.0  # a finished request's result is kept this long for its client to fetch
    session_timeout_s: float = 300.0  # a session without heartbeat this long ends, and its models go (SDK: every 10 s)
    torch_threads: int = 0  # torch CPU threads; 0 = auto (OMP_NUM_THREADS, else a share of the CPUs)

    def __post_init__(self) -> None:
        _need(0 <= self.port < 65536, "port", "must be in [0, 65535] (0 = a free port)")
        _need(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        _need(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        _need(self.max_models >= 1, "max_models", "must be >= 1")
        _need(self.max_samplers >= 1, "max_samplers", "must be >= 1")
        _need(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        _need(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _need(self.poll_s > 0, "poll_s", "must be > 0 (the SDK gives up on one poll after 45 s; keep it below)")
        _need(self.poll_s < 45, "poll_s", "must be < 45: the SDK waits 45 s for one poll's answer")
        _need(self.future_ttl_s > 0, "future_ttl_s", "must be > 0")
        _need(self.session_timeout_s >= 30, "session_timeout_s", "must be >= 30 (the SDK sends a heartbeat every 10 s)")
        _need(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0 = auto)")
        _need(":" not in self.base_model, "base_model", "must not hold ':' (the SDK cuts a model name at the first)")
