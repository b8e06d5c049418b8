"""The `calculator` tool: exact arithmetic on a bounded expression, parsed here by recursive descent (model text is
never handed to eval, exec, compile or ast).

Grammar (Python's own precedence and associativity, so `-2**2` is -4 and `2**-1` is 0.5):

    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/" | "//" | "%") unary)*
    unary   := ("+" | "-") unary | power
    power   := atom ("**" unary)?          # right-associative: 2**3**2 = 2**9
    atom    := number | "(" sum ")"
    number  := [0-9]+ ("." [0-9]*)? | "." [0-9]+

Every value is a `fractions.Fraction`, so the arithmetic is exact: 0.1 + 0.2 is 0.3, `/` is exact division, `//`
and `%` floor as Python's do. An integer result is written as an integer; any other as a decimal, exact when it
ends within SIGNIFICANT_DIGITS significant digits, else rounded (half to even) to that many.

Bounds, each refused with an `error: ...` text before the work they guard: the expression's length (MAX_LENGTH),
its nesting of brackets, signs and powers (MAX_DEPTH), a number's digits (MAX_DIGITS, for literals and for the
numerator and denominator of every result), and a power whose result would pass MAX_DIGITS (estimated as
exponent * log10(base) before computing it). A non-integer exponent is refused (its result is not exact)."""
from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_EVEN, Context, Decimal
from fractions import Fraction

from tools.registry import Tool

MAX_LENGTH = 500
MAX_DEPTH = 50
MAX_DIGITS = 1000
SIGNIFICANT_DIGITS = 20

SPACES = " \t\n\r\f\v"  # the ASCII whitespace TOKEN's \s* skips
# ASCII only: str.isdigit and \d (unicode) would also take characters such as '²' that int() reads differently
TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(\*\*|//|[-+*/%()]))", re.ASCII)


class CalculatorError(ValueError):
    """An expression the calculator refuses: its message is the tool's `error: ...` text."""


def tokenize(expression: str) -> list[str]:
    """The expression as numbers and operators; anything else is refused, naming where it stands."""
    tokens, position, expression = [], 0, expression.rstrip(SPACES)
    while position < len(expression):
        match = TOKEN.match(expression, position)
        if match is None:
            where = len(expression) - len(expression[position:].lstrip(SPACES))
            raise CalculatorError(f"unexpected character {expression[where]!r} at position {where}")
        tokens.append(match.group(1) or match.group(2))
        position = match.end()
    return tokens


def number(text: str) -> Fraction:
    """A literal as an exact fraction ("0.1" is 1/10), refused past MAX_DIGITS digits before int() reads it."""
    digits = text.replace(".", "")
    if len(digits) > MAX_DIGITS:
        raise CalculatorError(f"a number has {len(digits)} digits (at most {MAX_DIGITS})")
    return Fraction(int(digits), 10 ** len(text.partition(".")[2]))


def checked(value: Fraction) -> Fraction:
    """`value`, refused when its numerator or denominator has more than MAX_DIGITS digits."""
    for part in (value.numerator, value.denominator):
        # bits first, cheap: past 3.33 bits a digit a number surely has more than MAX_DIGITS digits; str() decides
        # the rest exactly (no value reaching here has more than about 2 * MAX_DIGITS digits: operands are checked)
        if abs(part).bit_length() > MAX_DIGITS * 3.33 or len(str(abs(part))) > MAX_DIGITS:
            raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
    return value


def power(base: Fraction, exponent: Fraction) -> Fraction:
    """base ** exponent for an integer exponent, refused before computing when the result would be too long."""
    if exponent.denominator != 1:
        raise CalculatorError("a non-integer exponent (the result would not be exact)")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    largest = max(abs(base.numerator), base.denominator)
    # |base| in {0, 1} stays small at any power; otherwise digits ~ |exponent| * log10(largest part of the base),
    # and log10(largest) >= log10(2) > 1/4 refuses a long exponent before it is turned into a float
    if largest > 1 and (abs(exponent) > 4 * MAX_DIGITS or abs(exponent) * math.log10(largest) > MAX_DIGITS + 1):
        raise CalculatorError(f"the power's result would have more than {MAX_DIGITS} digits")
    return checked(base ** int(exponent))


def apply(operator: str, left: Fraction, right: Fraction) -> Fraction:
    """One binary operation, exact; division by zero is refused."""
    if operator == "**":
        return power(left, right)
    if operator in ("/", "//", "%") and right == 0:
        raise CalculatorError("division by zero")
    if operator == "+":
        return checked(left + right)
    if operator == "-":
        return checked(left - right)
    if operator == "*":
        return checked(left * right)
    if operator == "/":
        return checked(left / right)
    if operator == "//":
        return checked(Fraction(left // right))
    return checked(left % right)


class Parser:
    """Recursive descent over the tokens, one method per rule of the grammar; `depth` counts the nested `unary`
    calls, which every bracket, sign and power passes through."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.position, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.position += 1
        return token

    def sum(self) -> Fraction:
        value = self.product()
        while self.peek() in ("+", "-"):
            operator = self.take()
            value = apply(operator, value, self.product())
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            operator = self.take()
            value = apply(operator, value, self.unary())
        return value

    def unary(self) -> Fraction:
        if self.depth > MAX_DEPTH:  # the outermost call is at depth 0: MAX_DEPTH brackets may nest
            raise CalculatorError(f"the expression nests deeper than {MAX_DEPTH}")
        self.depth += 1
        if self.peek() in ("+", "-"):
            value = self.unary() if self.take() == "+" else -self.unary()
        else:
            value = self.power()
        self.depth -= 1
        return value

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() == "**":
            self.take()
            return apply("**", base, self.unary())
        return base

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.sum()
            if self.peek() != ")":
                raise CalculatorError("a '(' is not closed")
            self.take()
            return value
        if token[0].isdigit() or token[0] == ".":
            return number(token)
        raise CalculatorError(f"expected a number or '(', found {token!r}")


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression` (see the module docstring for the grammar and bounds)."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression has {len(expression)} characters (at most {MAX_LENGTH})")
    parser = Parser(tokenize(expression))
    if parser.peek() is None:
        raise CalculatorError("the expression is empty")
    value = parser.sum()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def format_value(value: Fraction) -> str:
    """An integer as itself; any other value as a decimal, exact if it ends within SIGNIFICANT_DIGITS significant
    digits, else rounded half to even to that many."""
    if value.denominator == 1:
        return str(value.numerator)
    context = Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_HALF_EVEN)
    decimal = context.divide(Decimal(value.numerator), Decimal(value.denominator))
    text = format(decimal, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def calculate(arguments: dict) -> str:
    """The tool's function: the value of arguments["expression"], or `error: ...` saying what was refused."""
    try:
        return format_value(evaluate(arguments["expression"]))
    except CalculatorError as error:
        return f"error: {error}"


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** and brackets.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12.5 - 3) * 4 ** 2 / 7"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    function=calculate,
)
