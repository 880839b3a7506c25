"""lucebox: a single-GPU inference runtime for big open MoE models.

    import lucebox
    llm = lucebox.LLM("path/to/model")
    print(llm.generate("def quicksort(xs):", max_tokens=64).text)
"""

from lucebox._checkout import map_checkout_packages

map_checkout_packages()  # before anything imports lucebox.models or lucebox.kernels

from lucebox.errors import LuceboxError  # noqa: E402
from lucebox.generation import Chunk, Generation  # noqa: E402
from lucebox.llm import LLM  # noqa: E402
from lucebox.request_options import RequestOptions  # noqa: E402
from lucebox.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "Chunk", "Generation", "LuceboxError", "RequestOptions", "SamplingParams"]
__version__ = "0.1.0"
