"""What every attention variant shares: the protocol and registry (``base``), dense helpers (``reference``),
FlexAttention access (``flex``), SDPA for varying shapes (``sdpa``) and context parallelism
(``context_parallel``). Nothing here imports a variant."""
