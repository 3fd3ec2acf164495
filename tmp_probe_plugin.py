import torch


def pytest_runtest_teardown(item, nextitem):
    try:
        torch.randn(4, device="cuda")
        torch.cuda.synchronize()
        state = "rng ok"
    except Exception as error:  # noqa: BLE001
        state = f"rng BROKEN: {str(error).splitlines()[0][:100]}"
    print(f"\n[probe] after {item.nodeid}: {state}", flush=True)
