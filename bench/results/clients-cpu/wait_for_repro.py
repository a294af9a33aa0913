import asyncio, concurrent.futures, sys
async def main():
    cf = concurrent.futures.Future(); cf.set_result("grammar")   # a finished, cached compile
    done = asyncio.shield(asyncio.wrap_future(cf))
    print("asyncio future done right after wrap_future?", done.done())
    try: print(await asyncio.wait_for(done, 0.0))                   # deadline already past
    except TimeoutError: print("TimeoutError although the compile finished long ago")
asyncio.run(main()); print(sys.version)
