# A JSON-extraction workload (input text -> a JSON record whose values are copied from the input)
# for structured output with speculation: 10 schemas (nested objects, arrays, enums, numbers,
# strings with quotes and backslashes) x 5 records = 50 requests. `python
# examples/json_extraction.py` times plain constrained decoding against n-gram and suffix
# speculation (K = 4 and auto) at batch 1 on the default model, the engines taking turns request
# by request, and the grammar masks' share of a plain decode step (BENCHMARKS.md, session 13).
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STR, INT, NUM = {"type": "string", "maxLength": 48}, {"type": "integer"}, {"type": "number"}


def obj(**properties):
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


KINDS = [  # (schema, text template, records)
    (
        obj(name=STR, age=INT, email=STR, city=STR),
        "{name} is {age} years old, lives in {city} and can be reached at {email}.",
        [
            dict(name="Ada Lovelace", age=36, email="ada@example.org", city="London"),
            dict(name="Alan Turing", age=41, email="alan.turing@bletchley.uk", city="Wilmslow"),
            dict(name="Grace Hopper", age=85, email="grace@navy.mil", city="Arlington"),
            dict(name="Edsger Dijkstra", age=72, email="ewd@utexas.edu", city="Nuenen"),
            dict(name="Katherine Johnson", age=101, email="kj@nasa.gov", city="Hampton"),
        ],
    ),
    (
        obj(
            order_id=STR,
            status={"enum": ["pending", "shipped", "delivered"]},
            items={"type": "array", "items": obj(sku=STR, quantity=INT, price=NUM), "maxItems": 4},
        ),
        "Order {order_id} is {status}. It contains {items}.",
        [
            dict(
                order_id="A-1001",
                status="shipped",
                items=[dict(sku="KB-17", quantity=2, price=49.5)],
            ),
            dict(
                order_id="B-2002",
                status="pending",
                items=[
                    dict(sku="MS-3", quantity=1, price=19.99),
                    dict(sku="PAD-1", quantity=3, price=4.25),
                ],
            ),
            dict(
                order_id="C-3003",
                status="delivered",
                items=[dict(sku="USB-C", quantity=5, price=7.0)],
            ),
            dict(
                order_id="D-4004",
                status="shipped",
                items=[
                    dict(sku="HD-2T", quantity=1, price=89.9),
                    dict(sku="CAB-9", quantity=2, price=3.5),
                ],
            ),
            dict(
                order_id="E-5005",
                status="pending",
                items=[dict(sku="LMP-4", quantity=4, price=12.75)],
            ),
        ],
    ),
    (
        obj(
            title=STR,
            author=STR,
            year=INT,
            genres={
                "type": "array",
                "items": {"enum": ["novel", "poetry", "essay", "drama"]},
                "maxItems": 4,
            },
        ),
        'The book "{title}" by {author} came out in {year}; it is {genres}.',
        [
            dict(title='The "Real" Thing', author="Tom Stoppard", year=1982, genres=["drama"]),
            dict(title="Leaves of Grass", author="Walt Whitman", year=1855, genres=["poetry"]),
            dict(title="A Room of One's Own", author="Virginia Woolf", year=1929, genres=["essay"]),
            dict(title="Ulysses", author="James Joyce", year=1922, genres=["novel"]),
            dict(title='"Howl"', author="Allen Ginsberg", year=1956, genres=["poetry", "essay"]),
        ],
    ),
    (
        obj(
            event=STR,
            date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            venue=obj(city=STR, country=STR),
            attendees=INT,
        ),
        "{event} takes place on {date} in {city}, {country}, with {attendees} attendees.",
        [
            dict(
                event="PyCon", date="2024-05-15", city="Pittsburgh", country="USA", attendees=2500
            ),
            dict(
                event="FOSDEM",
                date="2025-02-01",
                city="Brussels",
                country="Belgium",
                attendees=8000,
            ),
            dict(
                event="EuroSciPy",
                date="2023-08-14",
                city="Basel",
                country="Switzerland",
                attendees=300,
            ),
            dict(
                event="JSConf", date="2024-09-26", city="Berlin", country="Germany", attendees=1200
            ),
            dict(
                event="NeurIPS",
                date="2023-12-10",
                city="New Orleans",
                country="USA",
                attendees=16000,
            ),
        ],
    ),
    (
        obj(
            product=STR,
            price=NUM,
            currency={"enum": ["USD", "EUR", "GBP"]},
            in_stock={"type": "boolean"},
            tags={"type": "array", "items": STR, "maxItems": 3},
        ),
        "The {product} costs {price} {currency}; in stock: {in_stock}. Tags: {tags}.",
        [
            dict(
                product="Trail Runner 3",
                price=129.99,
                currency="USD",
                in_stock=True,
                tags=["shoes", "running"],
            ),
            dict(product="Desk Lamp", price=34.5, currency="EUR", in_stock=False, tags=["home"]),
            dict(
                product="Tea Kettle",
                price=22.0,
                currency="GBP",
                in_stock=True,
                tags=["kitchen", "tea"],
            ),
            dict(
                product="Rain Jacket", price=89.0, currency="EUR", in_stock=True, tags=["outdoor"]
            ),
            dict(
                product="Chess Set",
                price=45.25,
                currency="USD",
                in_stock=False,
                tags=["games", "wood"],
            ),
        ],
    ),
    (
        obj(path=STR, size_bytes=INT, owner=STR),
        "The file {path} is {size_bytes} bytes long and belongs to {owner}.",
        [
            dict(path="C:\\Users\\ada\\notes.txt", size_bytes=2048, owner="ada"),
            dict(path="D:\\backup\\2024\\photos.zip", size_bytes=73400320, owner="bob"),
            dict(path="C:\\Program Files\\App\\config.ini", size_bytes=512, owner="admin"),
            dict(path="E:\\music\\jazz\\take5.mp3", size_bytes=6291456, owner="carol"),
            dict(path="C:\\temp\\log.txt", size_bytes=99, owner="system"),
        ],
    ),
    (
        obj(
            title=STR,
            director=STR,
            rating={"type": "number", "minimum": 0, "maximum": 10},
            cast={"type": "array", "items": STR, "maxItems": 4},
        ),
        "{title}, directed by {director}, is rated {rating} out of 10 and stars {cast}.",
        [
            dict(
                title="Casablanca",
                director="Michael Curtiz",
                rating=8.5,
                cast=["Humphrey Bogart", "Ingrid Bergman"],
            ),
            dict(title="Alien", director="Ridley Scott", rating=8.4, cast=["Sigourney Weaver"]),
            dict(title="Amelie", director="Jean-Pierre Jeunet", rating=8.3, cast=["Audrey Tautou"]),
            dict(
                title="Heat",
                director="Michael Mann",
                rating=8.3,
                cast=["Al Pacino", "Robert De Niro"],
            ),
            dict(title="Up", director="Pete Docter", rating=8.2, cast=["Ed Asner"]),
        ],
    ),
    (
        obj(
            company=STR, founded=INT, headquarters=obj(street=STR, city=STR, zip=STR), employees=INT
        ),
        "{company} was founded in {founded}. Its headquarters are at {street}, {zip} {city}, "
        "and it employs {employees} people.",
        [
            dict(
                company="Acme Corp",
                founded=1949,
                street="1 Main Street",
                city="Springfield",
                zip="12345",
                employees=5400,
            ),
            dict(
                company="Globex",
                founded=1989,
                street="42 Elm Road",
                city="Cypress Creek",
                zip="90210",
                employees=1200,
            ),
            dict(
                company="Initech",
                founded=1996,
                street="9 Office Park",
                city="Austin",
                zip="73301",
                employees=800,
            ),
            dict(
                company="Umbrella",
                founded=1968,
                street="7 Hive Lane",
                city="Raccoon City",
                zip="66600",
                employees=30000,
            ),
            dict(
                company="Hooli",
                founded=2004,
                street="1 Hacker Way",
                city="Palo Alto",
                zip="94301",
                employees=62000,
            ),
        ],
    ),
    (
        obj(speaker=STR, quote=STR, year=INT),
        'In {year}, {speaker} said: "{quote}"',
        [
            dict(
                speaker="Grace Hopper",
                quote='It\'s easier to ask forgiveness than "permission".',
                year=1986,
            ),
            dict(
                speaker="Alan Kay",
                quote="The best way to predict the future is to invent it.",
                year=1971,
            ),
            dict(speaker="Donald Knuth", quote='Beware of bugs in the "above" code.', year=1977),
            dict(speaker="Linus Torvalds", quote="Talk is cheap. Show me the code.", year=2000),
            dict(speaker="Ken Thompson", quote='When in doubt, use "brute force".', year=1982),
        ],
    ),
    (
        obj(
            flight=STR,
            origin=STR,
            destination=STR,
            seats_left=INT,
            cabin={"enum": ["economy", "business", "first"]},
        ),
        "Flight {flight} from {origin} to {destination} has {seats_left} {cabin} seats left.",
        [
            dict(
                flight="LH 400",
                origin="Frankfurt",
                destination="New York",
                seats_left=12,
                cabin="economy",
            ),
            dict(
                flight="BA 117",
                origin="London",
                destination="Boston",
                seats_left=3,
                cabin="business",
            ),
            dict(
                flight="AF 22", origin="Paris", destination="Montreal", seats_left=0, cabin="first"
            ),
            dict(
                flight="KL 605",
                origin="Amsterdam",
                destination="San Francisco",
                seats_left=27,
                cabin="economy",
            ),
            dict(
                flight="IB 6251",
                origin="Madrid",
                destination="Miami",
                seats_left=8,
                cabin="business",
            ),
        ],
    ),
]


def show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ", ".join(map(show, value))
    if isinstance(value, dict):  # an order's item
        return "{quantity} x {sku} at {price}".format(**value)
    return str(value)


def workload() -> list[tuple[str, dict]]:
    """50 (question, schema) pairs: the text to extract from, and the schema of the record."""
    out = []
    for schema, template, records in KINDS:
        for record in records:
            question = (
                "Extract the record from this text as JSON.\n\nText: "
                f"{template.format(**{k: show(v) for k, v in record.items()})}\n\n"
                f"Schema: {json.dumps(schema)}"
            )
            out.append((question, schema))
    return out


def main():
    from nanospec import LLM, SamplingParams
    from proposers import SuffixProposer

    p = argparse.ArgumentParser(description="plain vs speculative constrained decoding, batch 1")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeat", type=int, default=2, help="passes over the requests")
    p.add_argument("--every", type=int, default=1, help="every n-th request (5: one per schema)")
    args = p.parse_args()
    # No prefix caching: a later repeat must not find its prompts cached.
    kwargs = dict(dtype=args.dtype, enable_prefix_caching=False)
    engines = {
        "plain": LLM(**kwargs),
        "ngram K=4": LLM(draft="ngram", num_spec_tokens=4, **kwargs),
        "suffix K=4": LLM(draft="suffix", num_spec_tokens=4, **kwargs),
        "ngram auto": LLM(draft="ngram", **kwargs),
        "suffix auto": LLM(draft="suffix", **kwargs),
    }
    tokenizer = engines["plain"].tokenizer
    requests = [
        (tokenizer.apply_chat_template([{"role": "user", "content": q}]), schema)
        for q, schema in workload()[:: args.every]
    ]
    import controls

    mask_time = [0.0, 0]  # seconds in controls.apply (the grammar's masks: no other control here)

    def timed_apply(*a, **kw):
        start = time.perf_counter()
        result = apply(*a, **kw)
        mask_time[0], mask_time[1] = mask_time[0] + time.perf_counter() - start, mask_time[1] + 1
        return result

    apply, controls.apply = controls.apply, timed_apply
    times = {name: [] for name in engines}  # per (repeat, request)
    outputs = {name: [] for name in engines}
    masks = []  # per plain request: (ms of masks per step, ms per decode step)
    for _ in range(args.repeat):
        for llm in engines.values():  # a repeat must not draft from the last repeat's outputs
            if isinstance(llm.proposer, SuffixProposer):
                llm.proposer = SuffixProposer(max_requests=256)
        for prompt, schema in requests:  # batch 1; the engines take turns: noise hits them all
            params = SamplingParams(temperature=0, max_tokens=200, json_schema=schema)
            for name, llm in engines.items():
                mask_time[:], start = [0.0, 0], time.perf_counter()
                outputs[name] += llm.generate([prompt], params, use_progress=False)
                times[name].append(time.perf_counter() - start)
                if name == "plain":  # its masks per step against its decode steps (TPOT)
                    masks.append(
                        (1000 * mask_time[0] / mask_time[1], 1000 * outputs[name][-1].tpot)
                    )
    plain = outputs["plain"]
    num_tokens = sum(len(o.token_ids) for o in plain)
    for name in engines:
        outs = outputs[name]
        same = [o.token_ids for o in outs] == [o.token_ids for o in plain]
        parsed = sum(1 for o in outs if o.finish_reason == "stop" and json.loads(o.text))
        drafted, accepted = (
            sum(o.num_draft_tokens for o in outs),
            sum(o.num_accepted_tokens for o in outs),
        )
        pruned = sum(o.num_draft_tokens_pruned for o in outs)
        steps = num_tokens - accepted  # each step emits its accepted drafts and one token
        print(
            f"{name:12s} {sum(times[name]):6.1f} s  {num_tokens / sum(times[name]):5.1f} tok/s  "
            f"speedup {sum(times['plain']) / sum(times[name]):.2f}x (median per request "
            f"{statistics.median(p / t for p, t in zip(times['plain'], times[name])):.2f}x)  "
            f"tokens/step {num_tokens / steps:.2f}  identical to plain: {same}  "
            f"parsed {parsed}/{len(outs)}  drafted {drafted} accepted {accepted} cut {pruned}"
        )
    mask_ms, step_ms = (statistics.median(m[i] for m in masks) for i in (0, 1))
    print(
        f"grammar masks in plain decoding: {mask_ms:.3f} ms per step (median over requests), "
        f"a decode step (TPOT) {step_ms:.1f} ms: {100 * mask_ms / step_ms:.1f}%"
    )


if __name__ == "__main__":
    main()
