"""What both of this folder's scripts send: Qwen3-Reranker's template and the query."""

# llama.cpp's converter's template for Qwen3-Reranker (conversion/qwen.py)
TEMPLATE = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
            "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
            "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
            "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
QUERY = "How does cadence keep chat streams smooth while a long document prefills?"
