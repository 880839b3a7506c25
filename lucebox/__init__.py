"""lucebox: a single-GPU inference runtime for big open MoE models.

    import lucebox
    llm = lucebox.LLM("path/to/model")
    print(llm.generate("def quicksort(xs):", max_tokens=64).text)
"""

from lucebox.errors import LuceboxError
from lucebox.generation import Chunk, Generation
from lucebox.llm import LLM
from lucebox.sampling import SamplingParams

__all__ = ["LLM", "Chunk", "Generation", "LuceboxError", "SamplingParams"]
__version__ = "0.1.0"
